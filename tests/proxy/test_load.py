"""Many clients at once over HTTP: each request completes or is refused with 429, none hangs, memory stays bounded."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import openai
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from prefixgate.backends import StepRecord
from prefixgate.proxy import engine as engine_module
from prefixgate.proxy.engine import Engine
from tests.proxy.conftest import MODEL, Serve, chat_body, engine_of, on_event_loop, sample, scrape

CLIENTS = 48
BUDGET_BYTES = 6 * 512 * 512  # six requests of 512 tokens (prompt and max_tokens), at 512 bytes a token
HANG_GUARD_SECONDS = 300  # not a timing margin: a request still open after this long has hung


class AdmissionWatch(list[StepRecord]):
    """Record each step, with the running count and reserved KV bytes admission reports as it runs."""

    engine: Engine | None = None
    admitted: list[tuple[int, int]]

    def append(self, record: StepRecord) -> None:
        super().append(record)
        if self.engine is not None:
            stats = self.engine.backend.admission()
            self.admitted.append((stats.running, stats.bytes_in_use))


@pytest.fixture
def steps() -> list[StepRecord]:
    watch = AdmissionWatch()
    watch.admitted = []
    return watch


def document(index: int) -> str:
    """Return a long prompt of its own for client `index` (about 300 tokens of the tiny tokenizer)."""
    return f"Report {index}. " + " ".join(f"item {index * 31 + i} costs {i * 7 % 50} units;" for i in range(12))


async def one_client(client: TestClient[Any, Any], index: int, leave_after: int | None) -> str:
    """Stream one answer; leave after `leave_after` chunks if given. Say how it ended: done, left or 429."""
    body = chat_body(document(index), max_tokens=32, stream=True)
    async with client.post("/v1/chat/completions", json=body) as response:
        if response.status == 429:
            assert response.headers["Retry-After"] == "1"
            error = (await response.json())["error"]
            assert error["type"] == "rate_limit_error" and "at capacity" in error["message"]
            return "429"
        assert response.status == 200, await response.text()
        chunks = 0
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                return "done"
            if line.startswith(b"data: "):
                chunks += 1
                if leave_after is not None and chunks == leave_after:
                    response.close()  # the client drops its connection midway
                    return "left"
    raise AssertionError("the stream ended without [DONE]")


async def test_48_streaming_clients_complete_or_get_429_and_the_server_serves_on(
    serve: Serve, steps: AdmissionWatch
) -> None:
    client = await serve(max_running=8, max_waiting=12, kv_memory_budget=BUDGET_BYTES)
    steps.engine = engine_of(client)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(one_client(client, i, 4 if i % 3 == 0 else None) for i in range(CLIENTS))),
        HANG_GUARD_SECONDS,
    )
    assert set(outcomes) <= {"done", "left", "429"}
    assert outcomes.count("done") >= 6 and outcomes.count("left") >= 1
    # Six requests fit the budget: never more ran in one step, and admission never held more.
    assert max(len(step.seq_ids()) for step in steps) <= 6
    assert max(nbytes for _running, nbytes in steps.admitted) <= BUDGET_BYTES
    assert max(running for running, _nbytes in steps.admitted) == 6, "six ran at once at some point"
    # A client that left is noticed when the server next writes to it; then its request ends at the next step.
    backend = engine_of(client).backend
    await asyncio.wait_for(until(lambda: backend.admission().running == 0), HANG_GUARD_SECONDS)
    stats = backend.admission()
    assert (stats.running, stats.waiting, stats.bytes_in_use) == (0, 0, 0)
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_rejected_requests_total") == outcomes.count("429")
    assert sample(metrics, "prefixgate_num_requests_running") == sample(metrics, "prefixgate_num_requests_waiting") == 0
    assert sample(metrics, "prefixgate_kv_memory_bytes") == 0
    assert sample(metrics, "prefixgate_kv_memory_budget_bytes") == BUDGET_BYTES
    # The server and its store serve normally afterwards: a repeated prompt is served from the cache.
    again = await client.post("/v1/chat/completions", json=chat_body(document(1), max_tokens=4))
    assert again.status == 200
    assert (await again.json())["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def until(condition: Callable[[], bool]) -> None:
    """Return once `condition()` holds, checking between the event loop's other work."""
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_full_queue_answers_429_with_retry_after_in_openai_shape(serve: Serve) -> None:
    client = await serve(max_running=1, max_waiting=0)
    running = await client.post("/v1/chat/completions", json=chat_body(max_tokens=300, stream=True))
    assert running.status == 200
    await running.content.readline()  # its first chunk: it is running now
    api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert caught.value.response.headers["Retry-After"] == "1"
    assert caught.value.code == "server_overloaded"
    running.close()
    await api.close()


async def test_a_prompt_longer_than_the_context_gets_400_before_any_memory_is_reserved(serve: Serve) -> None:
    client = await serve(kv_memory_budget=BUDGET_BYTES)
    response = await client.post("/v1/chat/completions", json=chat_body("word " * 2000, max_tokens=4))
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded" and "maximum context length is 1024" in error["message"]
    assert engine_of(client).backend.admission().bytes_in_use == 0


MEGABYTE = 1_000_000
ADMIN_KEY = "admin-key-for-tests"
TOO_LONG: list[tuple[str, dict[str, Any], str]] = [
    ("more tokens than the context", chat_body("word " * 1200), "tokens, but the prompt has"),
    ("two megabytes of words", chat_body("word " * (2 * MEGABYTE // 5)), "characters besides whitespace"),
    ("a label and a megabyte of spaces", chat_body(system="request id" + " " * MEGABYTE), "characters, more than"),
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/admin/cache/warm"])
@pytest.mark.parametrize(("body", "words"), [row[1:] for row in TOO_LONG], ids=[row[0] for row in TOO_LONG])
async def test_a_prompt_beyond_the_context_gets_400_before_memory_or_the_store_are_touched(
    serve: Serve,
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
    route: str,
    body: dict[str, Any],
    words: str,
) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    engine = engine_of(client)
    touched: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            raise AssertionError(f"{name} was called for a prompt that cannot run")

        return call

    for name in ("seed", "fetch", "lookup", "put"):
        monkeypatch.setattr(engine.store, name, refuse(f"store.{name}"))
    monkeypatch.setattr(engine.backend, "reserve", refuse("reserve"))
    tokenized: list[int] = []  # the length of every text the tokenizer is given
    call = type(tokenizer).__call__

    def counted(self: PreTrainedTokenizerFast, text: Any, *args: Any, **kwargs: Any) -> Any:
        tokenized.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counted)
    response = await client.post(route, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    )
    assert "maximum context length is 1024 tokens" in error["message"] and "shorten the prompt" in error["message"]
    assert words in error["message"]
    assert touched == []
    limit = engine.backend.max_prompt_chars
    assert limit is not None and all(length <= limit for length in tokenized), "text beyond any context was tokenized"


async def test_health_answers_while_a_megabyte_prompt_is_prepared(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await serve()
    held, release = threading.Event(), threading.Event()
    on_loop: list[bool] = []
    lay_out = engine_module.lay_out  # the step that took hours on this prompt, on the loop, before it was linear

    def held_lay_out(*args: Any) -> Any:
        on_loop.append(on_event_loop())
        held.set()
        if on_loop[-1]:  # waiting for the test here would stop the test itself: fail instead
            raise AssertionError("the prompt was prepared on the event loop")
        release.wait()  # preparation is under way, in its thread, until the test lets it go on
        return lay_out(*args)

    monkeypatch.setattr(engine_module, "lay_out", held_lay_out)

    async def post() -> ClientResponse:
        return await client.post("/v1/chat/completions", json=chat_body(system="request id" + " " * MEGABYTE))

    request = asyncio.create_task(post())
    try:
        waiting = asyncio.create_task(asyncio.to_thread(held.wait))
        await asyncio.wait_for(
            asyncio.wait({request, waiting}, return_when=asyncio.FIRST_COMPLETED), HANG_GUARD_SECONDS
        )
        assert on_loop == [False]
        health = await client.get("/health")
        assert health.status == 200 and (await health.json())["status"] == "ok"
        assert not request.done() and not release.is_set()  # answered while the prompt is still being prepared
    finally:
        held.set()
        release.set()
    response = await asyncio.wait_for(request, HANG_GUARD_SECONDS)
    assert response.status == 400  # then the prompt is refused, being longer than the context
    assert (await response.json())["error"]["code"] == "context_length_exceeded"


class Fatal(BaseException):
    """A fault no request's step catches, raised on the model thread."""


class FailingSteps(list[StepRecord]):
    """Record steps; the third decode step raises Fatal on the model thread, outside any request's step."""

    def append(self, record: StepRecord) -> None:
        super().append(record)
        if len([step for step in self if step.tokens("decode")]) == 3:
            raise Fatal("the model thread broke")


@pytest.mark.parametrize("steps", [FailingSteps()])  # this test's model thread breaks on its third decode step
async def test_a_model_thread_that_stops_fails_requests_fast_and_health_says_so(
    serve: Serve, steps: list[StepRecord]
) -> None:
    client = await serve()
    running = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50, stream=True))
    assert running.status == 200
    body = (await asyncio.wait_for(running.read(), HANG_GUARD_SECONDS)).decode()
    assert "event: error" in body and "the model thread stopped (Fatal: the model thread broke)" in body
    health = await client.get("/health")
    assert health.status == 503
    assert (await health.json())["status"] == "unavailable"
    refused = await client.post("/v1/chat/completions", json=chat_body())
    assert refused.status == 503
    error = (await refused.json())["error"]
    assert error["type"] == "server_error" and "restart the server" in error["message"]
    assert engine_of(client).backend.admission().running == 0


async def test_a_client_that_leaves_as_its_stream_is_prepared_stops_the_generation(
    serve: Serve, steps: AdmissionWatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare = web.StreamResponse.prepare

    async def leave_at_prepare(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if self.content_type == "text/event-stream":
            raise ConnectionResetError("the client left")  # as the headers go out, after the first token
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", leave_at_prepare)
    client = await serve()
    await client.post("/v1/chat/completions", json=chat_body(max_tokens=300, stream=True))
    backend = engine_of(client).backend
    await asyncio.wait_for(until(lambda: backend.admission().running == 0), HANG_GUARD_SECONDS)
    assert sum(step.tokens("decode") for step in steps) < 20, "the model stopped within a step or two"
    assert engine_of(client).stats.snapshot().completion_tokens < 20
