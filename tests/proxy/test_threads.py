"""torch's CPU threads in a server: the model thread computes on every core, the loop's worker threads on one."""

from __future__ import annotations

import asyncio

import pytest
import torch

from prefixgate.backends import StepRecord
from tests.proxy.conftest import Serve, chat_body, engine_of


class ThreadCounts(list[StepRecord]):
    """Record each step, and the torch thread count of the thread that ran it."""

    counts: list[int]

    def append(self, record: StepRecord) -> None:
        super().append(record)
        self.counts.append(torch.get_num_threads())


@pytest.fixture
def steps() -> ThreadCounts:
    watch = ThreadCounts()
    watch.counts = []
    return watch


async def test_only_the_model_thread_runs_torch_on_more_than_one_thread(serve: Serve, steps: ThreadCounts) -> None:
    cores = torch.get_num_threads()  # what the test's own thread, like any new one, starts with
    client = await serve()
    response = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    assert response.status == 200
    assert steps.counts and set(steps.counts) == {cores}
    # The threads that prepare prompts and copy blocks make no OpenMP pool of their own.
    assert await asyncio.to_thread(torch.get_num_threads) == 1
    filer = engine_of(client)._filer
    assert await asyncio.wrap_future(filer.submit(torch.get_num_threads)) == 1
    assert torch.get_num_threads() == cores  # the event loop's own thread is left as it was
