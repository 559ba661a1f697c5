"""A request's choices (`n`) on the real app and the tiny Llama: each a generation of its own on one prompt computed
once, streamed side by side by index, seeded as vLLM seeds them, and refused whole when one cannot run."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prefixgate.backends import SamplingParams
from prefixgate.proxy.choices import Choices
from prefixgate.proxy.engine import PromptRequest
from tests.proxy.conftest import BLOCK_SIZE, MODEL, SYSTEM, HeldSteps, Serve, engine_of
from tests.proxy.conftest import chat_body as chat
from tests.proxy.test_http_api import sse_events
from tests.proxy.test_load import until


@pytest.fixture
def steps() -> HeldSteps:
    return HeldSteps()


async def test_n_choices_compute_the_prompt_once_and_each_samples_as_a_request_with_seed_plus_its_index(
    serve: Serve, steps: HeldSteps
) -> None:
    client = await serve()
    body = chat(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    answer = await (await client.post("/v1/chat/completions", json=body | {"n": 3})).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1, 2]
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3 * 8 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    # The prompt once; each other choice then finds all of it cached but the last token, whose logits it samples.
    assert sum(step.tokens("prefill") for step in steps) == usage["prompt_tokens"] + 2
    assert usage["prompt_tokens"] % BLOCK_SIZE > 1  # a partial last block, which the other choices reuse
    # The statistics count one request: its prompt once, uncached as its usage says, and every choice's tokens.
    stats = engine_of(client).stats.snapshot()
    assert (stats.requests, stats.prompt_tokens, stats.completion_tokens) == (1, usage["prompt_tokens"], 3 * 8)
    assert sum(stats.cached_tokens.values()) == 0 and stats.tenants[""].requests == 1
    contents = [choice["message"]["content"] for choice in answer["choices"]]
    assert len(set(contents)) == 3  # three seeds, three answers of 8 sampled tokens
    for index, content in enumerate(contents):
        alone = await (await client.post("/v1/chat/completions", json=body | {"seed": 11 + index})).json()
        assert alone["choices"][0]["message"]["content"] == content


async def test_n_choices_stream_side_by_side_each_with_its_role_content_and_finish(serve: Serve) -> None:
    client = await serve()
    whole = await (await client.post("/v1/chat/completions", json=chat(max_tokens=6))).json()
    body = chat(max_tokens=6, n=2, stream=True, stream_options={"include_usage": True})
    events = sse_events(await (await client.post("/v1/chat/completions", json=body)).text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert len({chunk["id"] for chunk in chunks}) == 1
    by_index: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]  # one choice a chunk, as OpenAI streams them
        by_index[choice["index"]].append(choice)
    expected = whole["choices"][0]
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert choices[-1]["delta"] == {} and choices[-1]["finish_reason"] == expected["finish_reason"]
        assert all(choice["finish_reason"] is None for choice in choices[:-1])
        assert "".join(choice["delta"].get("content", "") for choice in choices) == expected["message"]["content"]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 2 * whole["usage"]["completion_tokens"]
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


async def test_completions_n_choices_each_count_their_text_offsets_from_their_own_start(serve: Serve) -> None:
    client = await serve()
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0, "logprobs": 1, "n": 2}
    whole = await (await client.post("/v1/completions", json=body)).json()
    first, second = whole["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    # Greedy: the same tokens; their log probabilities as a batch rounds them (the second choice starts a step later).
    assert first["text"] == second["text"] and first["logprobs"]["tokens"] == second["logprobs"]["tokens"]
    assert first["logprobs"]["token_logprobs"] == pytest.approx(second["logprobs"]["token_logprobs"], abs=1e-4)
    events = sse_events(await (await client.post("/v1/completions", json=body | {"stream": True})).text())
    offsets: dict[int, list[int]] = {0: [], 1: []}
    for _, data in events[:-1]:
        (choice,) = json.loads(data)["choices"]
        offsets[choice["index"]] += (choice["logprobs"] or {}).get("text_offset", [])
    assert offsets[0] == offsets[1] == first["logprobs"]["text_offset"]


async def test_choices_of_a_scored_prompt_score_it_once_and_each_carries_its_log_probabilities(
    serve: Serve, steps: HeldSteps
) -> None:
    # echo with logprobs (how lm-eval scores a loglikelihood) and vLLM's prompt_logprobs: the first choice scores the
    # prompt and files it, the second reads it but for its last token, and carries the first's entries.
    client = await serve()
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    alone = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    before = sum(step.tokens("prefill") for step in steps)
    both = await (await client.post("/v1/completions", json=body | {"n": 2})).json()
    prompt = both["usage"]["prompt_tokens"]
    assert sum(step.tokens("prefill") for step in steps) - before == prompt + 1
    for choice in both["choices"]:
        columns, expected = choice["logprobs"], alone["logprobs"]
        assert choice["text"] == alone["text"] and columns["tokens"] == expected["tokens"]
        assert columns["token_logprobs"][0] is None
        assert columns["token_logprobs"][1:] == pytest.approx(expected["token_logprobs"][1:], abs=1e-4)
        assert [len(top) for top in columns["top_logprobs"][1:prompt]] == [
            len(top) for top in expected["top_logprobs"][1:prompt]
        ]
    vllm = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    alone_scored = (await (await client.post("/v1/completions", json=vllm)).json())["choices"][0]["prompt_logprobs"]
    answer = await (await client.post("/v1/completions", json=vllm | {"n": 3})).json()
    for choice in answer["choices"]:
        scored = choice["prompt_logprobs"]
        assert len(scored) == prompt and scored[0] is None
        assert [set(entries) for entries in scored[1:]] == [set(entries) for entries in alone_scored[1:]]


async def test_a_request_whose_choices_cannot_all_run_is_refused_whole_and_holds_nothing(
    serve: Serve, steps: HeldSteps
) -> None:
    client = await serve(max_running=1, max_waiting=0)
    steps.hold_kind = "decode"  # the admitted choice runs until released, so the other finds no room
    body = chat(n=2, max_tokens=300, ignore_eos=True)
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status == 429
    assert (await response.json())["error"]["code"] == "server_overloaded"
    steps.released.set()
    admission = engine_of(client).backend.admission
    await until(lambda: admission().running == 0 and admission().bytes_in_use == 0)
    after = await client.post("/v1/chat/completions", json=chat(max_tokens=4))
    assert after.status == 200


async def test_choices_closed_while_their_next_chunks_are_read_stop_the_reads_then_every_choice(
    serve: Serve, steps: HeldSteps
) -> None:
    # As when a write to a client that left fails: the reader leaves `chunks` where it stopped, the other choices' next
    # chunks still being read inside their generations, and closes the choices.
    client = await serve()
    engine = engine_of(client)
    steps.hold_kind, steps.hold_sequences = "decode", 3  # no chunk comes after this step's but those already out
    messages = [{"role": "user", "content": "Tell me a story"}]
    choices = await Choices.start(engine, PromptRequest(SamplingParams(max_tokens=300, ignore_eos=True), messages), 3)
    done = await steps.held()
    sequences = steps[-1].seq_ids()
    try:
        with pytest.raises(ConnectionResetError):
            async with choices:
                async for _ in choices.chunks():
                    await asyncio.sleep(0)  # the chunk's write, during which the reads under way run
                    if not any(read.done() for read in choices._reading):  # each waits in its generation
                        raise ConnectionResetError("Cannot write to closing transport")
    finally:
        steps.released.set()
    admission = engine.backend.admission
    await until(lambda: admission().running == 0 and admission().bytes_in_use == 0)
    await client.post("/v1/chat/completions", json=chat(max_tokens=2))
    assert all(sum(seq in step.seq_ids() for step in steps) <= done for seq in sequences)
