"""A reasoning model's answer split into reasoning and content: recorded answers cut at every point, reasoning opened
by the prompt or by the answer, cut off by the answer's end, answers that do not reason left as they are; and on the
tiny model with a reasoning template, the engine's chat answers against the text the model wrote."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from prefixgate.backends import HFBackend, SamplingParams, TokenChunk
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import assemble
from prefixgate.proxy.anthropic.api import MessageParam, MessagesRequest
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.openai.api import ChatCompletionRequest
from prefixgate.proxy.reasoning import ReasoningStream
from prefixgate.store import BlockLayout, StoreConfig, TierConfig, TieredStore
from tests.backends.tiny_models import make_llama, make_tokenizer

TAGS = ("<think>", "</think>")
# (the prompt opens the reasoning, the answer, its reasoning, its content)
RECORDED = [
    (False, "<think>\nThe user asks for a capital.\n</think>\n\nParis.", "The user asks for a capital.\n", "Paris."),
    (False, "  <think>Short.</think>Paris.", "Short.", "Paris."),
    (True, "\nThe user asks.\n</think>\n\nParis.", "The user asks.\n", "Paris."),
    (True, "Cut off while thinking about </thi", "Cut off while thinking about </thi", ""),
    (False, "Paris. A <think> tag later is text.", "", "Paris. A <think> tag later is text."),
    (False, "  Paris, with the white space it began with.", "", "  Paris, with the white space it began with."),
    (False, "<thin", "", "<thin"),
    (False, "<think></think>", "", ""),
]


def read(answer: list[str], *, opened: bool) -> tuple[str, str]:
    """Return the reasoning and content of an answer streamed in pieces, the last piece ending it."""
    stream = ReasoningStream(TAGS, opened=opened)
    chunks = [
        stream.chunk(TokenChunk(0, piece, "stop" if last else None))
        for last, piece in ((at == len(answer) - 1, piece) for at, piece in enumerate(answer))
    ]
    return "".join(chunk.reasoning for chunk in chunks), "".join(chunk.text for chunk in chunks)


def splits(text: str) -> Iterator[list[str]]:
    """Yield the text whole, character by character, and cut in two at every point."""
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


@pytest.mark.parametrize(("opened", "answer", "reasoning", "content"), RECORDED)
def test_an_answer_splits_into_reasoning_and_content_however_the_stream_cuts_it(
    opened: bool, answer: str, reasoning: str, content: str
) -> None:
    for pieces in splits(answer):
        assert read(pieces, opened=opened) == (reasoning, content), pieces


def test_a_piece_that_may_begin_a_tag_waits_until_it_is_one_or_is_not() -> None:
    stream = ReasoningStream(TAGS, opened=True)
    sent = stream.chunk(TokenChunk(0, "Thinking </th", None))
    assert (sent.reasoning, sent.text) == ("Thinking ", "")
    sent = stream.chunk(TokenChunk(0, "ose are words", None))
    assert (sent.reasoning, sent.text) == ("</those are words", "")


REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if opened %}<think>\n{% endif %}{% endif %}"
    "{# a reasoning model's: its answers think between <think> and </think> #}"
)


def engine_on(template: str) -> Engine:
    """Return an engine on the tiny Llama with this chat template, its store in memory."""
    tokenizer = make_tokenizer(template)
    backend = HFBackend(make_llama(tokenizer), tokenizer, model_id="tiny", block_size=8)
    g = backend.geometry
    config = StoreConfig(TierConfig(0), TierConfig(16 << 20), TierConfig(0))
    return Engine(backend, TieredStore.open(None, BlockLayout(g.block_shape, g.dtype), config))


def engine_with(opened: bool) -> Engine:
    return engine_on(REASONING_TEMPLATE.replace("{% if opened %}", "{% if true %}" if opened else "{% if false %}"))


async def chat(engine: Engine, **fields: Any) -> tuple[str, str]:
    request = PromptRequest(
        SamplingParams(max_tokens=24, temperature=0.0), messages=[{"role": "user", "content": "Capital?"}], **fields
    )
    generation = await engine.generate(request)
    async with generation:
        whole = assemble([chunk async for chunk in generation])
    return whole.reasoning, whole.text


@pytest.mark.parametrize("opened", [True, False], ids=["the-prompt-opens-it", "the-answer-would-open-it"])
async def test_a_reasoning_models_chat_answer_is_the_text_it_wrote_split(opened: bool) -> None:
    engine = engine_with(opened)
    try:
        assert engine.backend.reasoning_tags == TAGS
        engine.backend.reasoning_tags = None  # as a model that does not reason: the text as it was written
        _, written = await chat(engine)
        engine.backend.reasoning_tags = TAGS
        assert written and "<think>" not in written  # a random model opens no tag of its own
        # Opened by the prompt, all the random model wrote is reasoning; not opened, it is content as written.
        expected = (written.lstrip(), "") if opened else ("", written)
        assert await chat(engine) == expected
        # An answer held to a grammar is content from its first token, even where the prompt opened reasoning.
        reasoning, content = await chat(engine, response_format={"type": "json_object"})
        assert reasoning == "" and content.startswith("{")
    finally:
        await engine.close()


# Qwen3's switch: thinking opened in the prompt, unless `enable_thinking` is false, which closes it there, empty.
SWITCHED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}\n</think>\n\n{% endif %}{% endif %}"
)


async def test_thinking_is_switched_off_in_the_template_by_either_faces_request() -> None:
    engine = engine_on(SWITCHED_TEMPLATE)
    question = {"role": "user", "content": "Capital?"}

    def openai(kwargs: dict[str, Any] | None) -> PromptRequest:
        body = {
            "model": "tiny",
            "messages": [question],
            "max_tokens": 24,
            "temperature": 0,
            "chat_template_kwargs": kwargs,
        }
        return ChatCompletionRequest.model_validate(body).to_prompt_request("")

    def anthropic(thinking: dict[str, Any] | None) -> PromptRequest:
        body = {"model": "tiny", "messages": [question], "max_tokens": 2048, "temperature": 0, "thinking": thinking}
        return MessagesRequest.model_validate(body).to_prompt_request("")

    async def prompt_of(request: PromptRequest) -> tuple[int, ...]:
        return (await engine.prepare(request)).token_ids

    try:
        thinking, off = await prompt_of(openai(None)), await prompt_of(openai({"enable_thinking": False}))
        assert engine.backend.decode(off).endswith("</think>\n\n") and off != thinking  # closed, empty
        assert await prompt_of(openai({"enable_thinking": True})) == thinking
        assert await prompt_of(anthropic({"type": "disabled"})) == off
        assert await prompt_of(anthropic({"type": "enabled", "budget_tokens": 1024})) == thinking
        assert await prompt_of(anthropic(None)) == thinking
        # Opened by the prompt, all the random model writes is reasoning; closed there, it is content.
        reasoning, content = await chat(engine)
        assert reasoning and content == ""
        reasoning, content = await chat(engine, template_kwargs={"enable_thinking": False})
        assert reasoning == "" and content
        with pytest.raises(RequestError, match="may not set 'tokenize'") as refused:
            await prompt_of(openai({"tokenize": True}))
        assert refused.value.param == "chat_template_kwargs"
    finally:
        await engine.close()


async def test_a_template_variable_the_template_cannot_use_is_a_400() -> None:
    engine = engine_on("{% for m in messages %}{{ m['content'] + limit }}{% endfor %}")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"limit": 1}}
    try:
        with pytest.raises(RequestError, match="the chat template rejected these messages") as refused:
            await engine.prepare(ChatCompletionRequest.model_validate(body).to_prompt_request(""))
        assert refused.value.param == "messages"
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("thinking", "max_tokens", "words"),
    [
        ({"type": "enabled"}, 2048, "needs budget_tokens"),
        ({"type": "enabled", "budget_tokens": 2048}, 2048, "less than max_tokens"),
        ({"type": "disabled", "budget_tokens": 2048}, 4096, "goes with thinking enabled"),
    ],
    ids=["no-budget", "budget-past-max-tokens", "budget-while-disabled"],
)
def test_a_thinking_budget_anthropic_would_refuse_is_refused(
    thinking: dict[str, Any], max_tokens: int, words: str
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens}
    with pytest.raises(RequestError, match=words):
        MessagesRequest.model_validate(body | {"thinking": thinking}).to_prompt_request("")


RENDERING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_an_answers_reasoning_sent_back_by_either_face_reaches_the_chat_template() -> None:
    engine = engine_on(RENDERING_TEMPLATE)
    question = {"role": "user", "content": "Capital?"}
    # The openai client's dump of an answer carries the reasoning under both names; vLLM's newer name alone counts too.
    bodies = [
        {"role": "assistant", "content": "Paris.", "reasoning_content": "The capital.", "reasoning": "The capital."},
        {"role": "assistant", "content": "Paris.", "reasoning": "The capital."},
    ]
    anthropic_turn = MessageParam.model_validate(
        {
            "role": "assistant",
            "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "The capital.", "signature": ""},
                {"type": "text", "text": "Paris."},
            ],
        }
    )
    requests = [
        ChatCompletionRequest.model_validate({"model": "tiny", "messages": [question, body]}).to_prompt_request("t")
        for body in bodies
    ]
    requests.append(
        MessagesRequest(
            model="tiny", max_tokens=8, messages=[MessageParam(**question), anthropic_turn]
        ).to_prompt_request("t")
    )
    try:
        for request in requests:
            assert request.messages is not None
            turn = request.messages[-1]
            assert turn["reasoning_content"] == "The capital." and "reasoning" not in turn
            prepared = await engine.prepare(request)
            assert engine.backend.decode(prepared.token_ids).endswith(
                "assistant\n<think>\nThe capital.\n</think>\n\nParis.\nassistant\n"  # special tokens left out
            )
    finally:
        await engine.close()
