"""The model thread runs every request in each step and drops a request as soon as its consumer leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import torch

from prefixgate.backends import HFBackend, SamplingParams, StepRecord, Work
from prefixgate.backends.model_runner import StepInput
from prefixgate.backends.scheduler import STREAM_SLOWDOWN
from tests.backends.conftest import BackendFactory
from tests.backends.streams import BlockSink, collect
from tests.backends.test_kv_reuse import make_prompt

LONG = SamplingParams(max_tokens=200, temperature=0.0)


async def test_closing_the_stream_cancels_the_job_within_one_step(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(on_step=steps.append)
    stream = backend.generate(make_prompt(10), [], LONG)
    received = [await anext(stream), await anext(stream)]
    await stream.aclose()
    steps_at_close = len(steps_of(steps, 1))
    # Another request runs to its end; sequence 1 would have shared its steps had it survived.
    await collect(backend, make_prompt(10), params=SamplingParams(max_tokens=20, temperature=0.0))
    assert len(steps_of(steps, 1)) <= steps_at_close + 1
    assert len(steps_of(steps, 1)) < LONG.max_tokens
    assert len(received) == 2
    assert [s.seq_ids() for s in steps[-20:]] == [(2,)] * 20


async def test_breaking_out_of_the_loop_cancels_the_job(make_backend: BackendFactory, steps: list[StepRecord]) -> None:
    backend = make_backend(on_step=steps.append)
    async for _chunk in backend.generate(make_prompt(10), [], LONG):
        break  # the generator is finalized by the event loop's async-generator hook, not by us
    await collect(backend, make_prompt(10), params=SamplingParams(max_tokens=30, temperature=0.0))
    assert len(steps_of(steps, 1)) < 30


async def test_cancelling_the_consuming_task_cancels_the_job(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(on_step=steps.append)
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _chunk in backend.generate(make_prompt(10), [], LONG):
            first_token.set()

    task = asyncio.create_task(consume())
    await first_token.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    steps_at_cancel = len(steps)
    await collect(backend, make_prompt(10), params=SamplingParams(max_tokens=20, temperature=0.0))
    assert len(steps_of(steps, 1)) <= steps_at_cancel + 1
    assert len(steps_of(steps, 1)) < LONG.max_tokens


async def test_blocks_handed_back_before_cancellation_stay_handed_back(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    # RoPE has no learned positions, so the tiny Llama can take a context longer than its config says.
    backend = make_backend(prefill_chunk_tokens=8, context_length=4096, on_step=steps.append)
    sink = BlockSink()
    loop = asyncio.get_running_loop()
    first_block = asyncio.Event()

    def on_block(index: int, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        sink(index, token_ids, kv)
        loop.call_soon_threadsafe(first_block.set)

    task = asyncio.create_task(backend.prefill(make_prompt(4000), [], on_block))
    await first_block.wait()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    handed = list(sink.indices)
    await collect(backend, make_prompt(10), params=SamplingParams(max_tokens=5, temperature=0.0))
    assert sink.indices[: len(handed)] == handed
    assert len(sink.indices) <= len(handed) + 1
    assert len(sink.indices) < 400, "the 4,000-token prefill must stop long before its 500 blocks"


async def test_a_long_prefill_joins_a_running_decode_in_small_chunks(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    # A clock that never moves: steps cost nothing measurable, so the cap of 8 tokens is the whole budget.
    backend = make_backend(
        prefill_chunk_tokens=64, interleaved_prefill_tokens=8, on_step=steps.append, clock=lambda: 0.0
    )
    decoding = backend.generate(make_prompt(10), [], SamplingParams(max_tokens=60, temperature=0.0))
    await anext(decoding)  # sequence 1 is now decoding

    async def rest_of(stream: AsyncIterator[object]) -> int:
        return len([c async for c in stream])

    long_prompt = make_prompt(300, offset=11)
    _, generation = await asyncio.gather(rest_of(decoding), collect(backend, long_prompt, params=LONG))
    prefill_2 = [s for s in steps if Work(2, "prefill", s.tokens("prefill")) in s.work]
    # Beside a running stream, each step takes 8 prompt tokens and sequence 1's next token, in one forward pass.
    assert [s.tokens("prefill") for s in prefill_2] == [8] * 37 + [4]
    assert all(s.seq_ids() == (1, 2) and s.tokens("decode") == 1 for s in prefill_2)
    assert generation.finish_reason in ("stop", "length")


async def test_a_prompt_alone_is_prefilled_in_whole_chunks(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(prefill_chunk_tokens=64, interleaved_prefill_tokens=8, on_step=steps.append)
    await collect(backend, make_prompt(300, offset=11), params=SamplingParams(max_tokens=2, temperature=0.0))
    assert [s.tokens("prefill") for s in steps if s.tokens("prefill")] == [64, 64, 64, 64, 44]


async def test_prompts_admitted_together_are_prefilled_in_the_same_step(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    # A bound long enough never to be reached here: the second request's submission ends the wait, not the clock.
    backend = make_backend(prefill_chunk_tokens=64, on_step=steps.append, gather_seconds=60.0)
    prompts = [make_prompt(30), make_prompt(20, offset=5)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    first, second = [await backend.reserve(len(prompt), params.max_tokens) for prompt in prompts]
    one = asyncio.create_task(collect(backend, prompts[0], params=params, reservation=first))
    await gathering(backend)  # the first is submitted, and the model thread waits for the second
    assert not steps
    await asyncio.gather(one, collect(backend, prompts[1], params=params, reservation=second))
    assert steps[0].seq_ids() == (1, 2) and steps[0].tokens("prefill") == 50


async def test_a_request_given_up_on_its_way_is_not_waited_for(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(on_step=steps.append, gather_seconds=60.0)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    first = await backend.reserve(30, params.max_tokens)
    given_up = await backend.reserve(20, params.max_tokens)
    one = asyncio.create_task(collect(backend, make_prompt(30), params=params, reservation=first))
    await gathering(backend)
    given_up.release()  # its fetch failed, say: the engine releases it and the first goes on at once
    answer = await asyncio.wait_for(one, timeout=30)  # not the 60 s bound
    assert len(answer.token_ids) == 3 and steps and all(s.seq_ids() == (1,) for s in steps)


async def test_a_prompt_already_prefilling_does_not_wait_for_requests_on_their_way(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(prefill_chunk_tokens=16, on_step=steps.append, gather_seconds=60.0)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    long = asyncio.create_task(collect(backend, make_prompt(200), params=params))

    async def first_step() -> None:
        while not steps:
            await asyncio.sleep(0)

    await asyncio.wait_for(first_step(), timeout=30)
    on_its_way = await backend.reserve(20, params.max_tokens)  # admitted, and never submitted while `long` runs
    answer = await asyncio.wait_for(long, timeout=30)  # its remaining chunks do not wait out the 60 s bound
    assert len(answer.token_ids) == 2 and len(steps) > 10
    on_its_way.release()


async def gathering(backend: HFBackend) -> None:
    """Return once the model thread waits for requests on their way; fail if it has not within 30 s."""

    async def poll() -> None:
        while not backend._worker.gathering:
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout=30)


class VirtualClock:
    """A clock that only the model's steps move, each by what the test's cost model says the step costs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def slow(self, backend: HFBackend, *, decode: float, prompt_token: float, context_tokens: float) -> None:
        """Make each step of `backend` cost `decode` per decoded token, and `prompt_token` per prompt token at the
        start of its prompt, times `1 + context / context_tokens` after `context` positions."""
        run = backend._runner.run

        def costed(inputs: Sequence[StepInput]) -> torch.Tensor:
            for i in inputs:
                tokens = len(i.token_ids)
                self.now += decode if tokens == 1 else prompt_token * tokens * (1 + i.start / context_tokens)
            return run(inputs)

        backend._runner.run = costed  # type: ignore[method-assign]


async def test_a_long_prompt_beside_a_stream_keeps_each_step_within_the_slowdown(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    clock = VirtualClock()
    backend = make_backend(prefill_chunk_tokens=64, on_step=steps.append, clock=clock)
    # A decode step costs 10 ms; a prompt token 0.5 ms at the start of its prompt, and more the deeper it is.
    clock.slow(backend, decode=0.010, prompt_token=0.0005, context_tokens=backend._runner.context_tokens())
    decoding = backend.generate(make_prompt(10), [], LONG)
    await anext(decoding)
    await anext(decoding)  # the second token comes from a step of the stream alone: its cost is known

    async def rest_of(stream: AsyncIterator[object]) -> int:
        return len([c async for c in stream])

    _, generation = await asyncio.gather(rest_of(decoding), collect(backend, make_prompt(300, offset=11), params=LONG))
    beside = [s for s in steps if s.tokens("prefill") and s.tokens("decode")]
    assert beside, "the prompt was prefilled beside the stream"
    # Each such step took at most STREAM_SLOWDOWN times the stream's own step (the 10 ms), by the clock.
    assert max(s.seconds for s in beside) <= STREAM_SLOWDOWN * 0.010 + 1e-9
    assert max(s.seconds for s in beside) > (STREAM_SLOWDOWN - 0.5) * 0.010, "the budget is used, not wasted"
    # Deeper into the prompt each token attends to more, so chunks shrink.
    chunks = [s.tokens("prefill") for s in beside][:-1]  # the last is what was left of the prompt
    assert chunks == sorted(chunks, reverse=True) and chunks[0] > 2 * chunks[-1], chunks
    assert generation.finish_reason in ("stop", "length")


def steps_of(steps: list[StepRecord], seq_id: int) -> list[StepRecord]:
    """Return the steps sequence `seq_id` took part in."""
    return [s for s in steps if seq_id in s.seq_ids()]
