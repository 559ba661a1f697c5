"""`prefixgate serve --upstream` in front of two `prefixgate serve` processes on the real SmolLM2, driven by the
official `openai` client: an upstream killed mid-answer cuts its stream with an error event, never a hang; the
other takes the requests meanwhile; and the health checks bring the killed one back into rotation once it runs
again."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.services import Server

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-135m"

Start = Callable[..., Server]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    servers: list[Server] = []

    def starter(name: str, *flags: str, port: int | None = None) -> Server:
        server = Server(tmp_path / name, *flags, port=port)
        servers.append(server)
        return server

    yield starter
    for server in servers:
        server.stop()


def health(server: Server) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(server.get("/health"))
    return body


def test_a_killed_upstream_cuts_its_stream_and_comes_back_into_rotation(start: Start) -> None:
    first, second = start("first"), start("second")
    front = start(
        "front", "--upstream", f"{first.url}/v1", "--upstream", f"{second.url}/v1", "--upstream-check-interval", "1"
    )
    stream = front.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 200, one number per line."}],
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)  # the answer has begun
    busy = next(state["url"] for state in health(front)["upstreams"] if state["in_flight"])
    victim = first if busy == f"{first.url}/v1" else second
    victim.process.kill()  # SIGKILL: no goodbye
    with pytest.raises(openai.APIError, match=r"closed its answer before the end|broke off its answer"):
        for _ in chunks:
            pass

    for n in range(4):  # new requests go to the other upstream meanwhile
        reply = front.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Say hello {n}."}], max_tokens=4, temperature=0
        )
        assert reply.choices[0].message.content is not None
    states = {state["url"]: state for state in health(front)["upstreams"]}
    assert health(front)["status"] == "degraded" and not states[busy]["available"]

    start("restarted", port=victim.port)  # running again on the same port, with an empty cache
    deadline = time.monotonic() + 120  # checks run every second; the bound only stops a broken run hanging
    while health(front)["status"] != "ok":  # a health check finds it back: no request has to try it first
        assert time.monotonic() < deadline, "the restarted upstream never came back into rotation"
        time.sleep(0.2)
    before = {state["url"]: state["requests"] for state in health(front)["upstreams"]}[busy]
    for n in range(4):  # distinct prompts spread over both again
        front.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Prompt {n}. " * 40}], max_tokens=2, temperature=0
        )
    assert {state["url"]: state["requests"] for state in health(front)["upstreams"]}[busy] > before
