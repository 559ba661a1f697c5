"""Per-request sampling fields on the local model, through HTTP with the official `openai` client: logprobs and
top_logprobs (chat and completions, whole and streamed), logit_bias, presence and frequency penalties, min_tokens and
ignore_eos. Each request's fields act on its own answer only, also when requests share a step."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from tests.proxy.conftest import MODEL, SYSTEM, Serve

QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}]


def client_of(server: TestClient[Any, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)


async def test_greedy_logprobs_name_the_chosen_token_first_with_its_probability(serve: Serve) -> None:
    client = client_of(await serve())
    whole = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = whole.choices[0].logprobs and whole.choices[0].logprobs.content
    assert content is not None and len(content) == whole.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob) == (entry.token, entry.logprob)
        assert [top.logprob for top in entry.top_logprobs] == sorted(
            (top.logprob for top in entry.top_logprobs), reverse=True
        )
        assert entry.logprob <= 0 and sum(math.exp(top.logprob) for top in entry.top_logprobs) <= 1 + 1e-6
        assert entry.bytes == list(entry.token.encode())

    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, stream=True
    )
    streamed = [
        entry
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or ()
    ]
    # Warm now (the first request cached the prompt): the same tokens, their logprobs equal to float rounding.
    assert [entry.token for entry in streamed] == [entry.token for entry in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content, strict=True))
    assert all(entry.top_logprobs == [] for entry in streamed)  # none asked for

    text = await client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=5, temperature=0, logprobs=2)
    columns = text.choices[0].logprobs
    assert columns is not None and columns.tokens is not None and len(columns.tokens) == 5
    assert columns.top_logprobs is not None and all(len(top) <= 2 for top in columns.top_logprobs)
    assert columns.token_logprobs == [max(top.values()) for top in columns.top_logprobs]
    # Streamed, each chunk's text_offset goes on from the chunks before: the columns of the whole answer, in pieces.
    stream = await client.completions.create(
        model=MODEL, prompt=SYSTEM, max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    pieces = [chunk.choices[0].logprobs async for chunk in stream if chunk.choices and chunk.choices[0].logprobs]
    assert [offset for piece in pieces for offset in piece.text_offset or ()] == columns.text_offset
    plain = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None  # only when asked


async def test_logit_bias_min_tokens_and_ignore_eos_shape_the_answer(
    serve: Serve, tokenizer: PreTrainedTokenizerFast
) -> None:
    client = client_of(await serve())
    end = str(tokenizer.eos_token_id)
    fields: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    ended = await client.chat.completions.create(**fields, logit_bias={end: 100})
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)  # type: ignore[union-attr]
    later = await client.chat.completions.create(**fields, logit_bias={end: 100}, extra_body={"min_tokens": 3})
    assert (later.choices[0].finish_reason, later.usage.completion_tokens) == ("stop", 4)  # type: ignore[union-attr]
    ignored = await client.chat.completions.create(**fields, logit_bias={end: 100}, extra_body={"ignore_eos": True})
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 6)  # type: ignore[union-attr]

    plain = await client.chat.completions.create(**fields, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token  # type: ignore[union-attr, index]
    first_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first))[0]
    banned = await client.chat.completions.create(**fields, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first  # type: ignore[union-attr, index]


async def test_penalties_change_only_their_own_request_in_a_shared_step(serve: Serve) -> None:
    client = client_of(await serve())
    fields: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0}
    alone = await client.chat.completions.create(**fields, logprobs=True)
    tokens = [entry.token for entry in alone.choices[0].logprobs.content]  # type: ignore[union-attr]
    together = await asyncio.gather(
        client.chat.completions.create(**fields, logprobs=True),
        client.chat.completions.create(**fields, logprobs=True, frequency_penalty=2.0, presence_penalty=2.0),
    )
    plain, penalized = ([entry.token for entry in answer.choices[0].logprobs.content] for answer in together)  # type: ignore[union-attr]
    assert plain == tokens  # the penalized neighbour in its steps changed nothing here
    assert penalized != tokens


async def test_echo_puts_the_prompt_before_the_answer_and_with_logprobs_its_tokens_log_probabilities(
    serve: Serve, tokenizer: PreTrainedTokenizerFast
) -> None:
    client = client_of(await serve())
    fields: dict[str, Any] = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 5, "temperature": 0}
    plain = await client.completions.create(**fields, logprobs=2)  # also caches the prompt
    echoed = await client.completions.create(**fields, echo=True)
    assert echoed.choices[0].text == SYSTEM + plain.choices[0].text
    assert echoed.choices[0].logprobs is None  # none asked for: the prompt is not scored

    scored = await client.completions.create(**fields, echo=True, logprobs=2)
    usage = scored.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0  # the whole prompt computed, though it was cached
    columns, answer = scored.choices[0].logprobs, plain.choices[0].logprobs
    assert columns is not None and answer is not None and columns.tokens is not None and answer.tokens is not None
    prompt = len(tokenizer(SYSTEM)["input_ids"])
    assert usage.prompt_tokens == prompt and len(columns.tokens) == prompt + 5
    assert scored.choices[0].text == SYSTEM + plain.choices[0].text
    assert "".join(columns.tokens[:prompt]) == SYSTEM  # the prompt's tokens, then the answer's
    assert columns.tokens[prompt:] == answer.tokens
    assert columns.token_logprobs is not None and columns.top_logprobs is not None
    assert columns.token_logprobs[0] is None and columns.top_logprobs[0] is None  # nothing before the first token
    for logprob, top in zip(columns.token_logprobs[1:prompt], columns.top_logprobs[1:prompt], strict=True):
        assert logprob is not None and logprob <= 0 < len(top) <= 2 and logprob <= max(top.values())  # by text
    assert columns.token_logprobs[prompt:] == pytest.approx(answer.token_logprobs, abs=1e-4)
    assert columns.text_offset is not None and columns.text_offset[prompt] == len(SYSTEM)

    # Streamed: the first chunk carries the prompt and its columns, the text_offsets going on from them.
    stream = await client.completions.create(**fields, echo=True, logprobs=2, stream=True)
    chunks = [chunk.choices[0] async for chunk in stream if chunk.choices]
    assert "".join(choice.text for choice in chunks) == scored.choices[0].text
    assert chunks[0].text.startswith(SYSTEM)
    offsets = [offset for choice in chunks if choice.logprobs for offset in choice.logprobs.text_offset or ()]
    assert offsets == columns.text_offset

    # A long prompt's columns (more than 256 entries) are made and written out off the loop: the same answer.
    long = {**fields, "prompt": SYSTEM * 4, "echo": True, "logprobs": 1}
    whole = await client.completions.create(**long)
    assert whole.usage is not None and whole.usage.prompt_tokens > 256
    pieces = [chunk.choices[0] async for chunk in await client.completions.create(**long, stream=True) if chunk.choices]
    assert "".join(piece.text for piece in pieces) == whole.choices[0].text
    assert [o for piece in pieces if piece.logprobs for o in piece.logprobs.text_offset or ()] == (
        whole.choices[0].logprobs and whole.choices[0].logprobs.text_offset
    )

    # Token ids echo as the tokenizer decodes them.
    ids = tokenizer("The capital of France is")["input_ids"]
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert by_ids.choices[0].text.startswith(tokenizer.decode(ids))


async def test_prompt_logprobs_give_vllms_ranked_entries_by_token_id_for_both_apis(
    serve: Serve, tokenizer: PreTrainedTokenizerFast
) -> None:
    client = client_of(await serve())
    fields: dict[str, Any] = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 3, "temperature": 0}
    echoed = await client.completions.create(**fields, echo=True, logprobs=1)
    text = await client.completions.create(**fields, extra_body={"prompt_logprobs": 2})
    scored = (text.choices[0].model_extra or {})["prompt_logprobs"]
    ids = tokenizer(SYSTEM)["input_ids"]
    assert len(scored) == len(ids) and scored[0] is None  # nothing before the first token
    columns = echoed.choices[0].logprobs
    assert columns is not None and columns.token_logprobs is not None
    for position, entries in enumerate(scored[1:], start=1):
        own = entries[str(ids[position])]  # the prompt's token, with its rank among the vocabulary
        assert own["logprob"] == pytest.approx(columns.token_logprobs[position], abs=1e-4)
        assert own["rank"] >= 1 and own["decoded_token"] == tokenizer.decode([ids[position]])
        ranked = sorted(entry["rank"] for entry in entries.values())
        assert ranked[:2] == [1, 2] and len(entries) in (2, 3)  # the 2 alternatives, and the token where it is not one

    chat = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    whole = (chat.model_extra or {})["prompt_logprobs"]
    assert chat.usage is not None and len(whole) == chat.usage.prompt_tokens and whole[0] is None
    assert all(len(entries) == 1 for entries in whole[1:])  # the token alone
    with pytest.raises(openai.BadRequestError, match="leave out stream or prompt_logprobs"):
        await client.completions.create(**fields, stream=True, extra_body={"prompt_logprobs": 1})
