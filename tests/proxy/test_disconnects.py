"""A client that goes away before its answer is out stops the model at its next step, in prefill or decoding."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from prefixgate.backends import StepRecord
from tests.proxy.conftest import MODEL, Serve, engine_of

LONG = "the quick brown fox jumps over the lazy dog " * 60  # several hundred tokens: dozens of 16-token chunks


class SlowSteps(list[StepRecord]):
    """Records each model step after holding the model for 10 ms, so a prefill lasts long enough to leave."""

    def append(self, record: StepRecord) -> None:
        time.sleep(0.01)
        super().append(record)


@pytest.fixture
def steps() -> list[StepRecord]:
    return SlowSteps()


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


async def leave_when(steps: list[StepRecord], kind: str, request: asyncio.Task[Any]) -> int:
    """Cancel the client's request once the model runs a step of `kind`; return the steps run a moment later."""
    while not any(step.tokens(kind) for step in steps):
        await asyncio.sleep(0.001)
    request.cancel()  # the client closes its connection
    await asyncio.sleep(0.2)
    done = len(steps)
    await asyncio.sleep(0.3)
    assert len(steps) == done, "the model kept stepping after the client left"
    return done


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_during_a_long_prefill_stops_it_within_a_chunk(
    serve: Serve, steps: list[StepRecord], stream: bool
) -> None:
    client = await serve()
    prompt_tokens = len(engine_of(client).backend.render_chat(chat(LONG)["messages"]))
    request = asyncio.create_task(client.post("/v1/chat/completions", json=chat(LONG, stream=stream, max_tokens=5)))
    done = await leave_when(steps, "prefill", request)
    assert done < prompt_tokens // 16 // 2, "most of the prefill should never have run"
    assert all(step.tokens("decode") == 0 for step in steps)
    assert engine_of(client).stats.errors == 0  # a client that left is not a server error
    # The chunks computed before it left stay cached.
    response = await client.post("/v1/chat/completions", json=chat(LONG, max_tokens=1))
    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_client_that_leaves_a_whole_answer_request_stops_its_decoding(
    serve: Serve, steps: list[StepRecord]
) -> None:
    client = await serve()
    request = asyncio.create_task(client.post("/v1/chat/completions", json=chat("Tell me a story", max_tokens=400)))
    done = await leave_when(steps, "decode", request)
    assert done < 100
