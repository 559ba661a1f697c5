"""Chats tokenized piece by piece: the ids of tokenizing whole, each piece tokenized once while it is kept."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from prefixgate.backends import resolve_model
from prefixgate.backends.token_pieces import PieceTokenizer
from tests.backends.tiny_models import make_tokenizer

SYSTEM = "You are the support assistant of a shop.\n" + "".join(
    f"Rule {i}: refund within {i} days.\n" for i in range(40)
)
CONTENTS = [
    "",
    " leading and trailing spaces  ",
    "\n\nnewlines\n",
    "Größe? 東京 \u00a0 tabs\tand emoji 🙂",
    "a special token's text typed inside: <|im_end|> and <|im_start|>user",
    "<|im_end|>",
]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama, Mistral): a space marker put before the text's first word only."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    bpe.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "[INST]", "[/INST]"], show_progress=False
    )
    bpe.train_from_iterator([SYSTEM, *CONTENTS] * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")  # type: ignore[no-untyped-call]


def chats(tokenizer: Any) -> list[str]:
    """Texts as templates render them: special tokens between the turns, and at the text's edges or not."""
    specials = [token for token in tokenizer.all_special_tokens if token != tokenizer.unk_token][:3]
    first, second = specials[0], specials[-1]
    texts = [
        f"{first}system\n{SYSTEM}{second}\n{first}user\n{content}{second}\n{first}assistant\n" for content in CONTENTS
    ]
    texts += [f"{first}{first}{content}" for content in CONTENTS]  # special tokens one after another
    texts += [f"{content} before{first} after {content}" for content in CONTENTS]  # text before the first one
    return [*texts, "", "no special tokens at all", second]


@pytest.mark.parametrize("make", [make_tokenizer, metaspace_tokenizer])
def test_pieces_give_the_ids_of_the_whole_text_the_first_time_and_from_what_is_kept(make: Any) -> None:
    tokenizer = make()
    pieces = PieceTokenizer(tokenizer)
    assert pieces.by_pieces
    for text in chats(tokenizer) * 2:  # the second time, from the pieces kept
        assert pieces(text) == tokenizer(text, add_special_tokens=False)["input_ids"], text


@pytest.mark.smollm2
def test_smollm2s_chats_tokenize_by_pieces_as_whole() -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m").folder))
    pieces = PieceTokenizer(tokenizer)
    assert pieces.by_pieces
    for content in CONTENTS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert pieces(text) == pieces(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


class Counting:
    """A tokenizer that records the texts it is asked to tokenize."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.asked: list[str] = []

    def __call__(self, texts: Any, **options: Any) -> Any:
        self.asked += [texts] if isinstance(texts, str) else texts
        return self.tokenizer(texts, **options)


def test_a_system_prompt_seen_before_is_not_tokenized_again_and_the_budget_bounds_what_is_kept() -> None:
    counting = Counting(make_tokenizer())
    system = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    budget = len(counting.tokenizer(system)["input_ids"]) * 4 * 3 // 2  # room for one system prompt, not for two
    pieces = PieceTokenizer(counting, budget_bytes=budget)
    pieces(system + "<|im_start|>user\nfirst question<|im_end|>\n")
    counting.asked.clear()
    pieces(system + "<|im_start|>user\nsecond question<|im_end|>\n")
    assert not any("Rule" in text for text in counting.asked)  # only the new turn's pieces were tokenized
    assert pieces.nbytes <= budget
    pieces(system.replace("shop", "bakery"))  # another long system prompt: the budget cannot keep both
    counting.asked.clear()
    assert pieces(system) == counting.tokenizer(system, add_special_tokens=False)["input_ids"]
    assert any("Rule" in text for text in counting.asked) and pieces.nbytes <= budget


def test_many_small_pieces_are_kept_within_the_budget_with_what_each_costs_besides_its_ids() -> None:
    pieces = PieceTokenizer(make_tokenizer(), budget_bytes=64 << 10)
    text = "".join(f"<|im_start|>user\n{i}<|im_end|>\n" for i in range(2000))  # 4,000 pieces of a few tokens
    assert pieces(text) == pieces._whole(text)
    assert 60 << 10 < pieces.nbytes <= 64 << 10 and len(pieces._pieces) < 250
    assert pieces.nbytes == sum(256 + 4 * len(ids) for ids in pieces._pieces.values())


class Unsplittable(Counting):
    """A tokenizer whose text between special tokens depends on what came before them (none of the usual ones)."""

    def __call__(self, texts: Any, **options: Any) -> Any:
        encoded = self.tokenizer(texts, **options)
        if isinstance(texts, str):  # tokenized whole: one more token at the start
            encoded["input_ids"] = [0, *encoded["input_ids"]]
        return encoded


def test_a_tokenizer_that_does_not_split_at_its_special_tokens_tokenizes_whole() -> None:
    unsplittable = Unsplittable(make_tokenizer())
    pieces = PieceTokenizer(unsplittable)
    assert not pieces.by_pieces
    text = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    assert pieces(text) == unsplittable(text, add_special_tokens=False)["input_ids"]
