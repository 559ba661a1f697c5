"""The upstream pool against real OpenAI-compatible upstreams: two prefixgate servers on the tiny model, on local
ports. Streams, usage with the upstream's cached tokens, affinity, an upstream's 4xx passed on, and a dead upstream
retried elsewhere before the first token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixgate.backends.router import text_keys
from prefixgate.backends.upstream import UpstreamConfig, UpstreamError, UpstreamPool
from tests.proxy.conftest import MODEL, SYSTEM, Serve, chat_body
from tests.services import free_port


async def upstream_urls(serve: Serve, tmp_path: Path, count: int = 2) -> list[str]:
    clients = [await serve(store=tmp_path / f"upstream{index}") for index in range(count)]
    return [str(client.make_url("/v1")) for client in clients]


async def answer(pool: UpstreamPool, body: dict[str, Any], hint: str | None = None) -> tuple[str, Any, str]:
    """Return the whole answer, the upstream's usage and the upstream's URL."""
    keys = text_keys(str(body["messages"]))
    stream = await pool.open("chat/completions", body, keys, hint)
    try:
        text = "".join([chunk.text async for chunk in stream])
    finally:
        await stream.aclose()
    return text, stream.usage, stream.upstream.url


@pytest.fixture
async def pool_of() -> Any:
    pools: list[UpstreamPool] = []

    def make(urls: list[str]) -> UpstreamPool:
        pool = UpstreamPool([UpstreamConfig(url) for url in urls])
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.close()


async def test_a_stream_brings_the_answer_and_the_upstreams_usage(serve: Serve, tmp_path: Path, pool_of: Any) -> None:
    urls = await upstream_urls(serve, tmp_path)
    pool = pool_of(urls)
    text, usage, first = await answer(pool, chat_body())
    assert text and usage.prompt_tokens > 0 and usage.completion_tokens > 0 and usage.cached_tokens == 0
    again, usage, second = await answer(pool, chat_body())
    assert (again, second) == (text, first)  # the same prefix goes where it went before
    assert usage.cached_tokens > 0  # and that upstream's own cache served it
    assert pool.router.upstreams[0].in_flight == pool.router.upstreams[1].in_flight == 0
    assert await pool.models(pool.router.upstreams[0]) == [MODEL]


async def test_distinct_prompts_spread_over_the_upstreams(serve: Serve, tmp_path: Path, pool_of: Any) -> None:
    pool = pool_of(await upstream_urls(serve, tmp_path))
    used = {(await answer(pool, chat_body(system=f"System prompt number {n}. " * 30)))[2] for n in range(4)}
    assert len(used) == 2


async def test_an_upstreams_client_error_is_passed_on_and_not_retried(
    serve: Serve, tmp_path: Path, pool_of: Any
) -> None:
    pool = pool_of(await upstream_urls(serve, tmp_path))
    with pytest.raises(UpstreamError) as raised:
        await answer(pool, chat_body(model="no-such-model"))
    assert raised.value.status == 404 and not raised.value.retryable
    assert raised.value.body is not None and "no-such-model" in raised.value.body["error"]["message"]
    assert sum(upstream.requests for upstream in pool.router.upstreams) == 1
    assert all(upstream.failures == 0 for upstream in pool.router.upstreams)  # the client's fault, not theirs


async def test_a_dead_upstream_is_retried_elsewhere_and_leaves_rotation(
    serve: Serve, tmp_path: Path, pool_of: Any
) -> None:
    live = (await upstream_urls(serve, tmp_path, count=1))[0]
    dead = f"http://127.0.0.1:{free_port()}/v1"
    pool = pool_of([dead, live])
    body = chat_body(system=SYSTEM)
    text, _, used = await answer(pool, body)  # the first miss goes to the first upstream listed: the dead one
    assert used == live and text
    states = {upstream.url: upstream for upstream in pool.router.upstreams}
    assert states[dead].failures == 1 and states[dead].requests == 1
    assert states[live].failures == 0 and states[dead].in_flight == states[live].in_flight == 0
    with pytest.raises(LookupError, match="no upstream is available"):
        pool.router.choose(text_keys(SYSTEM), exclude=[states[live]])
