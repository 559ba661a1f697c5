"""Requests: rendering, decoding options, stop conditions, and clear errors for what the backend cannot serve."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, normalizers
from transformers import PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, SamplingParams, StepRecord
from prefixgate.errors import ContextLengthError, RequestError
from tests.backends.conftest import BackendFactory
from tests.backends.streams import GREEDY, collect
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.tiny_models import make_llama, make_tokenizer


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("max_tokens", 0, "at least 1"),
        ("temperature", -0.1, "between 0 and 2"),
        ("temperature", 2.5, "between 0 and 2"),
        ("temperature", float("nan"), "between 0 and 2"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "at most 1"),
        ("top_k", -1, "0 (off)"),
        ("seed", 2**64, "64-bit"),
        ("stop", ("",), "must not be empty"),
        ("stop", tuple(str(i) for i in range(17)), "at most 16"),
    ],
)
def test_out_of_range_sampling_params_name_the_field_and_the_limit(field: str, value: object, limit: str) -> None:
    with pytest.raises(RequestError, match=re.escape(limit)) as caught:
        SamplingParams(**{field: value})
    assert caught.value.param == field


def test_requests_it_cannot_serve_fail_before_any_compute(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(on_step=steps.append)  # context 512
    cases: list[tuple[list[int], SamplingParams, type[RequestError], str, str]] = [
        (make_prompt(513), GREEDY, ContextLengthError, "prompt", "512 tokens"),
        (make_prompt(500), SamplingParams(max_tokens=13), ContextLengthError, "max_tokens", "at most 12"),
        ([], GREEDY, RequestError, "prompt", "empty"),
        ([5, 10_000], GREEDY, RequestError, "prompt", "ids run from 0 to"),
    ]
    for prompt, params, error, param, message in cases:
        with pytest.raises(error, match=message) as caught:
            backend.generate(prompt, [], params)
        assert caught.value.param == param
    assert steps == []


async def test_prompt_plus_max_tokens_may_fill_the_context_exactly(make_backend: BackendFactory) -> None:
    backend = make_backend()
    result = await collect(backend, make_prompt(500), params=SamplingParams(max_tokens=12, temperature=0.0))
    assert len(result.token_ids) <= 12


async def test_greedy_stops_at_max_tokens_with_finish_reason_length(make_backend: BackendFactory) -> None:
    result = await collect(make_backend(), make_prompt(10), params=SamplingParams(max_tokens=7, temperature=0))
    assert len(result.token_ids) == 7
    assert result.finish_reason == "length"
    assert result.text == make_backend().decode(result.token_ids)


async def test_stop_string_ends_the_stream_and_is_never_emitted(make_backend: BackendFactory) -> None:
    backend = make_backend()
    prompt = make_prompt(10)
    free = await collect(backend, prompt, params=SamplingParams(max_tokens=40, temperature=0))
    text = free.text
    assert len(text) > 10
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # spans token boundaries in general
    stopped = await collect(backend, prompt, params=SamplingParams(max_tokens=40, temperature=0, stop=(stop, "\x00")))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
    assert all(stop not in piece for piece in stopped.texts)


async def test_eos_token_ends_the_stream_with_finish_reason_stop(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = make_llama(tokenizer)
    prompt = make_prompt(10)
    backend = make_backend(model)
    free = await collect(backend, prompt)
    # Make the third greedy token an end-of-sequence id of the generation config.
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, free.token_ids[2]]
    ended = await collect(make_backend(model), prompt)
    assert ended.token_ids == free.token_ids[:3]
    assert ended.finish_reason == "stop"
    # The end-of-sequence token's own text is left out; text still pending from earlier tokens is flushed.
    assert ended.text == backend.decode(free.token_ids[:2])
    assert ended.text != backend.decode(free.token_ids[:3])


async def test_seeded_sampling_is_reproducible_and_seeds_differ(make_backend: BackendFactory) -> None:
    backend = make_backend()
    prompt = make_prompt(10)

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=20, temperature=1.5, top_p=0.95, top_k=50, seed=seed)

    first = await collect(backend, prompt, params=params(1))
    again = await collect(backend, prompt, params=params(1))
    other = await collect(backend, prompt, params=params(2))
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


async def test_top_k_1_and_tiny_top_p_sample_the_greedy_tokens(make_backend: BackendFactory) -> None:
    backend = make_backend()
    prompt = make_prompt(10)
    greedy = await collect(backend, prompt)
    top_k = await collect(backend, prompt, params=SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3))
    top_p = await collect(backend, prompt, params=SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-6, seed=4))
    assert top_k.token_ids == greedy.token_ids
    assert top_p.token_ids == greedy.token_ids


def test_render_chat_uses_the_models_template_and_opens_the_assistant_turn(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    backend = make_backend()
    ids = backend.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = backend.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert backend.render_text("Hi there") == tokenizer("Hi there")["input_ids"]


def test_render_chat_without_a_template_says_to_use_completions(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    backend = make_backend()
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(RequestError, match="completions") as caught:
            backend.render_chat([{"role": "user", "content": "Hi"}])
    finally:
        tokenizer.chat_template = template
    assert caught.value.param == "messages"


def test_render_chat_gives_the_tokens_the_chat_template_gives(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    messages = [
        {"role": "system", "content": "Be brief.  \n\n"},
        {"role": "user", "content": "What does <|im_end|> mean? naïve café 🙂"},
    ]
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert make_backend().render_chat(messages) == encoded["input_ids"]


def test_text_beyond_any_context_is_refused_before_it_is_tokenized(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_backend()  # context 512
    longest = max(map(len, tokenizer.get_vocab()))
    assert backend.max_prompt_chars == 512 * longest * 4
    tokenized: list[int] = []
    call = type(tokenizer).__call__

    def counted(self: PreTrainedTokenizerFast, text: Any, *args: Any, **kwargs: Any) -> Any:
        tokenized.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counted)
    fits = "a" * backend.max_prompt_chars
    assert backend.render_text(fits) and tokenized == [len(fits)]
    with pytest.raises(ContextLengthError, match=f"512 tokens, and the prompt has {len(fits) + 1} characters") as text:
        backend.render_text(fits + "a")
    with pytest.raises(ContextLengthError, match="shorten the prompt") as chat:
        backend.render_chat([{"role": "user", "content": fits}])  # the template adds text of its own
    assert text.value.param == chat.value.param == "prompt"
    assert tokenized == [len(fits)]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_no_text_has_fewer_tokens_than_the_character_bound_allows(
    tokenizer: PreTrainedTokenizerFast, text: str
) -> None:
    longest = max(map(len, tokenizer.get_vocab()))
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) * longest >= len(text)


def test_a_tokenizer_that_collapses_whitespace_bounds_no_prompt_by_characters() -> None:
    collapsing = make_tokenizer()
    collapsing.backend_tokenizer.normalizer = normalizers.Replace(Regex(r"\s+"), " ")
    backend = HFBackend(make_llama(collapsing), collapsing, model_id="tiny-llama", block_size=8)
    try:
        assert backend.max_prompt_chars is None
        assert len(backend.render_text("a" + " " * 100_000 + "b")) < 10  # so 100,000 characters may fit in 512 tokens
    finally:
        backend.close()
