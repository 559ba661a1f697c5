"""Many requests share each forward pass, and each answer is still its own: the tokens it would get alone."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from prefixgate.backends import HFBackend, SamplingParams, StepRecord
from tests.backends.conftest import BackendFactory
from tests.backends.streams import BlockSink, Generation, collect
from tests.backends.test_kv_reuse import make_prompt

PROMPTS = [make_prompt(length, offset) for length, offset in ((10, 3), (37, 5), (23, 11), (61, 17))]
LONGER = SamplingParams(max_tokens=40, temperature=0.0)


class StepWatch:
    """Record steps, and let a coroutine wait for the first step that matches a condition."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self._loop = asyncio.get_running_loop()
        self._waiters: list[tuple[asyncio.Future[None], int]] = []

    def __call__(self, record: StepRecord) -> None:
        self.steps.append(record)
        for future, size in self._waiters:
            if len(record.seq_ids()) >= size:
                self._loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    async def step_with(self, sequences: int) -> None:
        """Return once a step ran at least `sequences` sequences together."""
        future = self._loop.create_future()
        self._waiters.append((future, sequences))
        await future


async def alone(backend: HFBackend, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> list[Generation]:
    """Run each request by itself, one after another."""
    return [await collect(backend, prompt, params=p) for prompt, p in zip(prompts, params, strict=True)]


async def test_requests_run_together_get_the_tokens_each_gets_alone(make_backend: BackendFactory) -> None:
    watch = StepWatch()
    backend = make_backend(on_step=watch)
    expected = await alone(backend, PROMPTS, [LONGER] * 4)
    watch.steps.clear()
    together = await asyncio.gather(*(collect(backend, prompt, params=LONGER) for prompt in PROMPTS))
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]
    assert [g.text for g in together] == [g.text for g in expected]
    # They shared forward passes: four streams decoding in one step, and fewer steps than run one after another.
    assert max(len(step.seq_ids()) for step in watch.steps) == 4
    assert len(watch.steps) < sum(len(g.token_ids) for g in expected)


async def test_each_request_keeps_its_own_sampling_seed_stop_and_length(make_backend: BackendFactory) -> None:
    backend = make_backend()
    greedy = await collect(backend, PROMPTS[0], params=LONGER)
    stop = greedy.text[len(greedy.text) // 2 :][:2]
    assert stop.strip(), "the greedy text must give a stop string"
    settings = [
        SamplingParams(max_tokens=30, temperature=1.0, seed=7),
        SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=8),
        SamplingParams(max_tokens=30, temperature=1.2, top_p=0.5, seed=9),
        SamplingParams(max_tokens=5, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,)),
    ]
    prompts = [*PROMPTS, PROMPTS[0]]
    expected = await alone(backend, prompts, settings)
    together = await asyncio.gather(*(collect(backend, p, params=s) for p, s in zip(prompts, settings, strict=True)))
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]
    assert [g.finish_reason for g in together] == [g.finish_reason for g in expected]
    assert len(together[3].token_ids) == 5 and together[3].finish_reason == "length"
    assert together[4].finish_reason == "stop" and together[4].text == greedy.text[: greedy.text.index(stop)]
    assert len({tuple(g.token_ids) for g in together[:3]}) == 3, "sampled requests do not share one generator"


async def test_a_request_cancelled_mid_batch_leaves_the_others_untouched(make_backend: BackendFactory) -> None:
    watch = StepWatch()
    backend = make_backend(on_step=watch)
    expected = await alone(backend, PROMPTS[:3], [LONGER] * 3)
    leaving = backend.generate(PROMPTS[3], [], SamplingParams(max_tokens=200, temperature=0.0))
    await anext(leaving)
    others = [asyncio.create_task(collect(backend, prompt, params=LONGER)) for prompt in PROMPTS[:3]]
    await watch.step_with(4)
    await leaving.aclose()
    results = await asyncio.gather(*others)
    assert [g.token_ids for g in results] == [g.token_ids for g in expected]
    leaving_id = 4  # the first three ran alone as sequences 1 to 3
    last_step = max(i for i, step in enumerate(watch.steps) if leaving_id in step.seq_ids())
    assert len([s for s in watch.steps[last_step:] if len(s.seq_ids()) == 3]) > 10, "the others ran on without it"
    assert backend.admission().running == 0


async def test_a_failing_request_among_healthy_ones_fails_alone(make_backend: BackendFactory) -> None:
    backend = make_backend()
    expected = await alone(backend, PROMPTS[:3], [LONGER] * 3)

    def broken_store(index: int, tokens: Sequence[int], kv: torch.Tensor) -> None:
        raise OSError("the store's disk is full")

    results = await asyncio.gather(
        *(collect(backend, prompt, params=LONGER) for prompt in PROMPTS[:3]),
        collect(backend, PROMPTS[3], params=LONGER, on_block=broken_store),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert isinstance(results[3], OSError)
    assert [g.token_ids for g in results[:3]] == [g.token_ids for g in expected]  # type: ignore[union-attr]
    assert backend.admission().running == 0 and backend.admission().bytes_in_use == 0
    # The model thread serves on.
    assert (await collect(backend, PROMPTS[0], params=LONGER)).token_ids == expected[0].token_ids


async def test_requests_from_cached_prefixes_and_fresh_ones_share_steps(make_backend: BackendFactory) -> None:
    watch = StepWatch()
    backend = make_backend(on_step=watch)
    sink = BlockSink()
    first = await collect(backend, PROMPTS[3], params=LONGER, on_block=sink)
    fresh = await collect(backend, PROMPTS[1], params=LONGER)
    watch.steps.clear()
    together = await asyncio.gather(
        collect(backend, PROMPTS[3], sink.blocks[:5], params=LONGER), collect(backend, PROMPTS[1], params=LONGER)
    )
    assert [g.token_ids for g in together] == [first.token_ids, fresh.token_ids]
    assert watch.steps[0].tokens("prefill") < len(PROMPTS[3]) + len(PROMPTS[1]), "40 cached tokens are not computed"


@pytest.mark.parametrize("interleaved", [1, 5])
async def test_prefill_beside_decoding_streams_never_exceeds_the_interleaved_budget(
    make_backend: BackendFactory, interleaved: int
) -> None:
    watch = StepWatch()
    backend = make_backend(prefill_chunk_tokens=32, interleaved_prefill_tokens=interleaved, on_step=watch)
    expected = await alone(backend, PROMPTS, [LONGER] * 4)
    watch.steps.clear()
    together = await asyncio.gather(*(collect(backend, prompt, params=LONGER) for prompt in PROMPTS))
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]
    for step in watch.steps:
        budget = interleaved if step.tokens("decode") else 32
        assert step.tokens("prefill") <= budget
