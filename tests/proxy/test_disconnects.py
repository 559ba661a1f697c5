"""A client that goes away before its answer is out stops the model at its next step, in prefill or decoding.

No test here waits on the clock: the model thread is held after a chosen step while the client leaves, and the test
learns that the server has dropped the request from the request's own hand-off being closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from prefixgate.backends import StepRecord
from prefixgate.backends.handoff import LoopHandoff
from tests.proxy.conftest import HANG_GUARD_SECONDS, MODEL, HeldSteps, Serve, engine_of

LONG = "the quick brown fox jumps over the lazy dog " * 60  # several hundred tokens: dozens of 16-token chunks


@pytest.fixture
def steps() -> HeldSteps:
    return HeldSteps()


@pytest.fixture
def closed_handoffs(monkeypatch: pytest.MonkeyPatch) -> Iterator[asyncio.Queue[None]]:
    """Report each request whose hand-off closes: the server has let go of it, and its sequence is cancelled."""
    closed: asyncio.Queue[None] = asyncio.Queue()
    original = LoopHandoff.close

    def close(self: LoopHandoff) -> None:
        original(self)
        closed.put_nowait(None)  # the backend cancels the sequence right after, in the same synchronous block

    monkeypatch.setattr(LoopHandoff, "close", close)
    yield closed


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


async def leave_while_held(
    steps: HeldSteps, closed: asyncio.Queue[None], kind: str, request: asyncio.Task[Any]
) -> tuple[int, int]:
    """Leave once the model is held after a step of `kind`; return the steps run then and its sequence id."""
    steps.hold_kind = kind
    done = await steps.held()
    seq_id = steps[-1].seq_ids()[0]
    request.cancel()  # the client closes its connection
    await asyncio.wait_for(closed.get(), HANG_GUARD_SECONDS)
    steps.released.set()
    return done, seq_id


def steps_of(steps: list[StepRecord], seq_id: int) -> int:
    return sum(seq_id in step.seq_ids() for step in steps)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_during_a_long_prefill_stops_it_at_the_next_step(
    serve: Serve, steps: HeldSteps, closed_handoffs: asyncio.Queue[None], stream: bool
) -> None:
    client = await serve()
    prompt_tokens = len(engine_of(client).backend.render_chat(chat(LONG)["messages"]))
    assert prompt_tokens // 16 > 4  # many prefill chunks, so stopping after the first one shows
    request = asyncio.create_task(client.post("/v1/chat/completions", json=chat(LONG, stream=stream, max_tokens=5)))
    done, seq_id = await leave_while_held(steps, closed_handoffs, "prefill", request)
    # The chunks computed before it left stay cached; the next request runs only after the left one was dropped.
    response = await client.post("/v1/chat/completions", json=chat(LONG, max_tokens=1))
    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert steps_of(steps, seq_id) == done == 1, "the model kept computing the prompt of a client that left"
    assert all(step.tokens("decode") == 0 for step in steps if seq_id in step.seq_ids())
    assert engine_of(client).stats.errors == 0  # a client that left is not a server error


async def test_a_client_that_leaves_a_whole_answer_request_stops_its_decoding(
    serve: Serve, steps: HeldSteps, closed_handoffs: asyncio.Queue[None]
) -> None:
    client = await serve()
    request = asyncio.create_task(client.post("/v1/chat/completions", json=chat("Tell me a story", max_tokens=400)))
    done, seq_id = await leave_while_held(steps, closed_handoffs, "decode", request)
    await client.post("/v1/chat/completions", json=chat("Another one", max_tokens=1))
    assert steps_of(steps, seq_id) == done


async def test_a_client_that_leaves_mid_stream_stops_its_generation(
    serve: Serve, steps: HeldSteps, closed_handoffs: asyncio.Queue[None]
) -> None:
    client = await serve()
    body = chat("Tell me a long story", stream=True, max_tokens=400)
    response = await client.post("/v1/chat/completions", json=body)
    await response.content.readline()  # the role chunk is out: generation is running
    response.close()  # the client goes away; the server sees it when it next writes
    await asyncio.wait_for(closed_handoffs.get(), HANG_GUARD_SECONDS)
    ran = len(steps)
    again = await (await client.post("/v1/chat/completions", json=chat("Tell me a long story"))).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its prompt blocks stayed cached
    left = steps[0].seq_ids()[0]
    # Cancelled between steps, it runs in at most the step then under way.
    assert steps_of(steps, left) <= ran + 1 < 100


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_a_request_of_n_choices_stops_every_choice(
    serve: Serve, steps: HeldSteps, closed_handoffs: asyncio.Queue[None], stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    client = await serve()
    body = chat("Tell me a story", n=3, max_tokens=400, ignore_eos=True, stream=stream)
    request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    steps.hold_kind, steps.hold_sequences = "decode", 3  # held once all three decode in the same step
    done = await steps.held()
    choices = set(steps[-1].seq_ids())
    if request.done():  # streamed: the response is open
        request.result().close()
    else:
        request.cancel()
    for _ in choices:
        await asyncio.wait_for(closed_handoffs.get(), HANG_GUARD_SECONDS)
    steps.released.set()
    await client.post("/v1/chat/completions", json=chat("Another one", max_tokens=1))
    assert all(steps_of(steps, seq_id) <= done for seq_id in choices)
    # A client that leaves is no fault of the server's: nothing is logged as one.
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
