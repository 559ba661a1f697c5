"""Admission: running requests stay within the KV budget and count, the rest wait in order, and a full queue refuses."""

from __future__ import annotations

import asyncio

import pytest

from prefixgate.backends import SamplingParams, StepRecord
from prefixgate.backends.admission import RETRY_AFTER_SECONDS, Admission
from prefixgate.errors import ContextLengthError, OverloadedError, RequestError
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt

TOKEN_BYTES = 2 * 2 * 2 * 16 * 4  # the tiny Llama: layers, K and V, kv_heads, head_dim, float32
LONG = SamplingParams(max_tokens=100, temperature=0.0)


async def started(coroutine: asyncio.Task[None]) -> None:
    """Let a task run until it waits."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert not coroutine.done()


async def test_requests_enter_while_bytes_and_count_allow_then_wait_in_order() -> None:
    admission = Admission(budget_bytes=100, max_running=2, max_waiting=5)
    await admission.enter(60)
    order: list[str] = []

    async def enter(name: str, nbytes: int) -> None:
        await admission.enter(nbytes)
        order.append(name)

    big = asyncio.create_task(enter("big", 50))  # 60 + 50 > 100: waits
    await started(big)
    small = asyncio.create_task(enter("small", 10))  # would fit, but does not overtake the one waiting first
    await started(small)
    assert admission.stats().waiting == 2 and admission.stats().bytes_in_use == 60
    admission.leave(60)
    await asyncio.gather(big, small)
    assert order == ["big", "small"]
    stats = admission.stats()
    assert (stats.running, stats.waiting, stats.bytes_in_use) == (2, 0, 60)
    third = asyncio.create_task(enter("third", 1))  # bytes fit; the running count does not
    await started(third)
    admission.leave(10)
    await third
    assert admission.stats().running == 2


async def test_a_full_queue_refuses_with_a_retry_delay() -> None:
    admission = Admission(budget_bytes=10, max_running=1, max_waiting=1)
    await admission.enter(10)
    waiting = asyncio.create_task(admission.enter(10))
    await started(waiting)
    with pytest.raises(OverloadedError, match="at capacity: 1 requests running and 1 waiting") as caught:
        await admission.enter(1)
    assert caught.value.retry_after == RETRY_AFTER_SECONDS
    admission.leave(10)
    await waiting


async def test_a_request_larger_than_the_whole_budget_is_refused_at_once() -> None:
    admission = Admission(budget_bytes=10, max_running=1, max_waiting=1)
    with pytest.raises(RequestError, match="more than the server's whole budget of 10") as caught:
        await admission.enter(11)
    assert caught.value.param == "max_tokens"


async def test_a_waiter_that_leaves_gives_up_its_place_and_lets_the_next_in() -> None:
    admission = Admission(budget_bytes=100, max_running=4, max_waiting=4)
    await admission.enter(50)
    blocked = asyncio.create_task(admission.enter(80))
    await started(blocked)
    behind = asyncio.create_task(admission.enter(40))
    await started(behind)
    blocked.cancel()
    await asyncio.gather(blocked, return_exceptions=True)
    await behind  # the head of the queue left, and what was behind it fits
    assert admission.stats().waiting == 0 and admission.stats().bytes_in_use == 90


async def test_a_waiter_cancelled_as_it_is_admitted_gives_its_share_back() -> None:
    admission = Admission(budget_bytes=10, max_running=1, max_waiting=1)
    await admission.enter(10)
    waiting = asyncio.create_task(admission.enter(10))
    await started(waiting)
    admission.leave(10)  # admits the waiter; its wake-up is queued on the loop
    waiting.cancel()  # and it leaves before it runs
    await asyncio.gather(waiting, return_exceptions=True)
    assert admission.stats().running == 0 and admission.stats().bytes_in_use == 0


async def test_the_backend_queues_a_request_until_a_running_one_ends(make_backend: BackendFactory) -> None:
    backend = make_backend(max_running=1)
    first = backend.generate(make_prompt(10), [], LONG)
    await anext(first)
    second = asyncio.create_task(collect(backend, make_prompt(12), params=SamplingParams(max_tokens=3)))
    while backend.admission().waiting == 0:
        await asyncio.sleep(0)
    assert backend.admission().running == 1
    await first.aclose()
    assert len((await second).token_ids) == 3
    stats = backend.admission()
    assert (stats.running, stats.waiting, stats.bytes_in_use) == (0, 0, 0)


async def test_each_request_reserves_its_prompt_and_max_tokens(make_backend: BackendFactory) -> None:
    backend = make_backend()
    reservation = await backend.reserve(300, 100)
    assert reservation.tokens == 448 and reservation.nbytes == 448 * TOKEN_BYTES  # whole blocks of 64 tokens
    assert backend.admission().bytes_in_use == reservation.nbytes
    reservation.release()
    assert backend.admission().bytes_in_use == 0


async def test_the_kv_budget_bounds_running_requests_and_the_rest_wait(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    budget = 3 * 64 * TOKEN_BYTES  # room for three requests of under 64 tokens each
    backend = make_backend(kv_memory_budget=budget, on_step=steps.append)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    results = await asyncio.gather(*(collect(backend, make_prompt(40, offset), params=params) for offset in range(8)))
    assert all(result.finish_reason is not None for result in results)
    assert max(len(step.seq_ids()) for step in steps) == 3, "three requests fit the budget, and three ran together"


async def test_a_prompt_longer_than_the_context_is_refused_before_anything_is_reserved(
    make_backend: BackendFactory,
) -> None:
    backend = make_backend()  # context 512
    with pytest.raises(ContextLengthError, match="512 tokens, but the prompt has 100000") as caught:
        await backend.reserve(100_000, 1)
    assert caught.value.param == "prompt"
    with pytest.raises(ContextLengthError, match="lower max_tokens to at most 12") as caught:
        await backend.reserve(500, 13)
    assert caught.value.param == "max_tokens"
    assert backend.admission().running == 0 and backend.admission().bytes_in_use == 0


async def test_a_request_refused_by_generate_gives_its_reservation_back(make_backend: BackendFactory) -> None:
    backend = make_backend()
    reservation = await backend.reserve(10, 5)
    with pytest.raises(RequestError, match="outside this model's vocabulary"):
        params = SamplingParams(max_tokens=5, logit_bias=((10**9, 1.0),))
        backend.generate(make_prompt(10), [], params, reservation=reservation)
    assert backend.admission().running == 0 and reservation.buffer is None
