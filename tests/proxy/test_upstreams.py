"""`prefixgate serve --upstream`: a server in front of OpenAI-compatible upstreams, which here are two prefixgate
servers on the tiny model, on local ports, all driven over HTTP by the official `openai` client. Routing by prefix,
canonicalization and layout in front of the upstreams, tenants kept apart, usage passed through, failover, and what
`/health`, `/metrics` and `/admin/cache` say."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient

from prefixgate.errors import ConfigError
from prefixgate.proxy.app import create_app
from prefixgate.proxy.serving import ENGINE
from prefixgate.proxy.settings import load_settings
from prefixgate.proxy.upstream_engine import UpstreamEngine
from tests.proxy.conftest import (
    HANG_GUARD_SECONDS,
    MODEL,
    SYSTEM,
    HeldSteps,
    Serve,
    ServedApp,
    sample,
    scrape,
)
from tests.services import free_port

ADMIN = {"Authorization": "Bearer sk-admin"}
Front = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def steps() -> HeldSteps:
    return HeldSteps()


@pytest.fixture
async def upstreams(serve: Serve, tmp_path: Path) -> list[str]:
    """Two prefixgate servers on the tiny model, each with its own store: their base URLs."""
    clients = [await serve(store=tmp_path / f"upstream{index}", api_keys={"sk-up": "front"}) for index in range(2)]
    return [str(client.make_url("/v1")) for client in clients]


@pytest.fixture
async def front(tmp_path: Path) -> AsyncIterator[Front]:
    """Start servers in front of upstreams, as `prefixgate serve --upstream URL ...` would."""
    clients: list[TestClient[Any, Any]] = []

    async def start(urls: list[str], **overrides: Any) -> TestClient[Any, Any]:
        overrides.setdefault("upstream_api_keys", {url: "sk-up" for url in urls})
        overrides.setdefault("model", MODEL)
        settings = load_settings(upstream=urls, store=tmp_path / "front", admin_key="sk-admin", **overrides)
        client: TestClient[Any, Any] = TestClient(ServedApp(create_app(settings)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def openai_client(client: TestClient[Any, Any], api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=api_key, max_retries=0)


async def ask(
    client: TestClient[Any, Any], system: str, question: str, *, api_key: str = "unused", **fields: Any
) -> Any:
    return await openai_client(client, api_key).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=6,
        temperature=0,
        **fields,
    )


async def per_upstream(client: TestClient[Any, Any]) -> dict[str, dict[str, Any]]:
    health = await (await client.get("/health")).json()
    return {state["url"]: state for state in health["upstreams"]}


async def test_answers_stream_or_not_with_the_upstreams_usage(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    first = await ask(client, SYSTEM, "What is the capital of France?")
    again = await ask(client, SYSTEM, "What is the capital of France?")
    assert first.choices[0].message.content and again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same upstream, and its own cache
    assert again.usage.prompt_tokens == first.usage.prompt_tokens

    stream = await openai_client(client).chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens

    text = await openai_client(client).completions.create(model=MODEL, prompt=SYSTEM, max_tokens=4, temperature=0)
    assert text.choices[0].text and text.usage is not None

    states = await per_upstream(client)
    assert sum(state["requests"] for state in states.values()) == 4
    assert sum(state["cached_tokens"] for state in states.values()) >= again.usage.prompt_tokens_details.cached_tokens
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_requests_total") == 4
    assert sample(metrics, "prefixgate_prefix_cache_hits_by_tier_total", tier="upstream") > 0
    assert sum(sample(metrics, "prefixgate_upstream_requests_total", upstream=url) for url in upstreams) == 4
    report = await (await client.get("/admin/cache", headers=ADMIN)).json()
    assert [state["url"] for state in report["upstreams"]] == upstreams and report["totals"]["requests"] == 4
    assert (await client.get("/admin/cache/entries", headers=ADMIN)).status == 400  # no cache of its own here


async def test_a_prompt_of_token_ids_reaches_the_upstream_as_ids(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    tokenize = upstreams[0].removesuffix("/v1") + "/tokenize"  # the upstreams' tokenizer: the front refuses it
    async with aiohttp.ClientSession() as session, session.post(tokenize, json={"prompt": SYSTEM}) as tokenized:
        tokens = (await tokenized.json())["tokens"]
    completions = openai_client(client).completions
    as_text = await completions.create(model=MODEL, prompt=SYSTEM, max_tokens=4, temperature=0)
    as_ids = await completions.create(model=MODEL, prompt=tokens, max_tokens=4, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(tokens)


async def test_anthropic_clients_are_served_from_the_upstreams_too(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    messages = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="unused", max_retries=0).messages
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "system": SYSTEM, "extra_body": {"temperature": 0}}
    first = await messages.create(messages=[{"role": "user", "content": "Hi?"}], **fields)
    again = await messages.create(messages=[{"role": "user", "content": "Hi?"}], **fields)
    assert again.content[0].text == first.content[0].text
    assert first.usage.cache_read_input_tokens == 0 and again.usage.cache_read_input_tokens > 0  # the upstream's
    # The upstream (prefixgate, as vLLM) names the stop string that ended its answer: the client is told which.
    stop = first.content[0].text.strip()[1:3]
    assert stop, f"the tiny model's answer is too short to take a stop sequence from: {first.content[0].text!r}"
    stopped = await messages.create(messages=[{"role": "user", "content": "Hi?"}], stop_sequences=[stop], **fields)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == first.content[0].text[: first.content[0].text.index(stop)]
    with pytest.raises(anthropic.BadRequestError, match="forwards to upstreams"):
        await messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi?"}])
    with pytest.raises(anthropic.BadRequestError, match="forwards to upstreams"):
        await messages.create(messages=[{"role": "user", "content": "Hi?"}], **fields | {"max_tokens": 0})
    for path, body in (("/tokenize", {"prompt": "Hi?"}), ("/detokenize", {"tokens": [1]})):
        refused = await client.post(path, json=body)
        assert refused.status == 400 and "forwards to upstreams" in (await refused.json())["error"]["message"]


async def test_one_prefix_sticks_to_one_upstream_and_distinct_ones_spread(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    for n in range(4):
        await ask(client, SYSTEM, f"Question {n}?")
    assert sorted(state["requests"] for state in (await per_upstream(client)).values()) == [0, 4]
    for n in range(4):
        await ask(client, f"You are assistant number {n}. " * 8, "Hello?")
    assert all(state["requests"] >= 2 for state in (await per_upstream(client)).values())


async def test_a_burst_of_one_prefix_spills_to_the_idle_upstream_once_its_own_is_busy(
    front: Front, upstreams: list[str], steps: HeldSteps
) -> None:
    client = await front(upstreams, upstream_balance=2)
    steps.hold_kind = "prefill"  # the model of the upstream that takes the first request stops after one step
    first = asyncio.create_task(ask(client, SYSTEM, "Question 0?"))
    await steps.held()
    burst = [asyncio.create_task(ask(client, SYSTEM, f"Question {n}?")) for n in range(1, 5)]
    engine = client.server.app[ENGINE]
    assert isinstance(engine, UpstreamEngine)
    router = engine.pool.router
    deadline = time.monotonic() + HANG_GUARD_SECONDS
    while sum(upstream.requests for upstream in router.upstreams) < 5:  # every request of the burst is routed
        assert time.monotonic() < deadline, "the burst was never routed"
        await asyncio.sleep(0.01)
    held, idle = sorted(router.upstreams, key=lambda upstream: -upstream.in_flight)
    steps.released.set()
    await asyncio.gather(first, *burst)
    assert held.requests >= 2 and idle.requests >= 1  # it took the burst's share the held one was too busy for


async def test_timestamped_system_prompts_reach_the_upstream_with_one_prefix(
    front: Front, upstreams: list[str]
) -> None:
    client = await front(upstreams)
    await ask(client, f"Now: 2026-12-01T09:14:07Z. {SYSTEM}", "Hi?")
    later = await ask(client, f"Now: 2026-12-01T09:15:52Z. {SYSTEM}", "Hi?")
    assert later.usage.prompt_tokens_details.cached_tokens > 0  # layout moved the time out of the prefix


async def test_tenants_never_share_an_upstreams_cache(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams, api_keys={"sk-a": "acme", "sk-b": "globex"})
    await ask(client, SYSTEM, "Hi?", api_key="sk-a")
    assert (await ask(client, SYSTEM, "Hi?", api_key="sk-b")).usage.prompt_tokens_details.cached_tokens == 0
    assert (await ask(client, SYSTEM, "Hi?", api_key="sk-a")).usage.prompt_tokens_details.cached_tokens > 0


async def test_a_dead_upstream_is_skipped_and_health_says_degraded(front: Front, upstreams: list[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    client = await front([upstreams[0], dead], upstream_api_keys={upstreams[0]: "sk-up"})
    for n in range(3):
        assert (await ask(client, f"Prompt {n}. " * 20, "Hi?")).choices[0].message.content is not None
    health = await client.get("/health")
    body = await health.json()
    assert health.status == 200 and body["status"] == "degraded"
    states = {state["url"]: state for state in body["upstreams"]}
    assert not states[dead]["available"] and states[upstreams[0]]["available"]


async def test_a_health_check_finds_a_stopped_upstream_before_any_request_does(
    serve: Serve, front: Front, tmp_path: Path
) -> None:
    servers = [await serve(store=tmp_path / f"upstream{index}", api_keys={"sk-up": "front"}) for index in range(2)]
    urls = [str(server.make_url("/v1")) for server in servers]
    client = await front(urls, upstream_check_interval=3600)  # only the checks this test asks for
    engine = client.server.app[ENGINE]
    assert isinstance(engine, UpstreamEngine)
    await engine.check()
    assert (await (await client.get("/health")).json())["status"] == "ok"
    await servers[1].close()
    await engine.check()
    health = await (await client.get("/health")).json()
    assert health["status"] == "degraded" and not (await per_upstream(client))[urls[1]]["available"]
    assert (await per_upstream(client))[urls[1]]["requests"] == 0  # no request had to find it gone
    for n in range(3):  # and they go on on the other
        assert (await ask(client, f"Prompt {n}. " * 20, "Hi?")).choices[0].message.content is not None


async def explain(client: TestClient[Any, Any], system: str, question: str, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    response = await client.post(
        "/admin/cache/explain", json={"model": MODEL, "messages": messages} | fields, headers=ADMIN
    )
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def test_explain_says_which_upstream_a_request_would_go_to_and_why(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    fresh = await explain(client, SYSTEM, "Question 0?")
    assert fresh["object"] == "route.explanation" and fresh["route"]["reason"] == "spread"
    assert fresh["route"]["matched_characters"] == 0 and fresh["prompt_characters"] > 0
    await ask(client, SYSTEM, "Question 0?")
    holder = next(url for url, state in (await per_upstream(client)).items() if state["requests"])

    again = await explain(client, SYSTEM, "Question 1?")
    assert (again["route"]["upstream"], again["route"]["reason"]) == (holder, "prefix")
    assert again["route"]["matched_characters"] >= 0.3 * again["prompt_characters"]
    assert again["summary"].startswith(f"{holder} would take it: it was sent the first")
    held = {state["url"]: state["matched_characters"] for state in again["upstreams"]}
    assert held[holder] == again["route"]["matched_characters"] and sum(held.values()) == held[holder]
    assert (await ask(client, SYSTEM, "Question 1?")).usage.prompt_tokens_details.cached_tokens > 0
    assert (await per_upstream(client))[holder]["requests"] == 2  # where explain said, and explain sent nothing

    hinted = await explain(client, "Something else entirely. " * 30, "Hi?", prompt_cache_key="user-42")
    assert hinted["route"]["reason"] == "hint" and hinted["hint"] == "user-42"
    assert "prompt_cache_key" in hinted["summary"]
    await ask(client, f"Now: 2026-12-01T09:14:07Z. {SYSTEM}", "Hi?")
    stamped = await explain(client, f"Now: 2026-12-01T09:15:52Z. {SYSTEM}", "Hi?")
    assert [moved["value"] for moved in stamped["layout"]["moved"]] == ["2026-12-01T09:15:52Z"]
    assert stamped["messages"][0]["content"].startswith("Now: [datetime 1].")
    assert stamped["route"]["reason"] == "prefix"  # laid out, it starts as the prompt sent a minute before

    wrong = await client.post("/admin/cache/explain", json={"model": "gpt-4o", "prompt": "Hi"}, headers=ADMIN)
    assert wrong.status == 404


async def test_an_upstreams_client_error_comes_back_as_it_wrote_it(front: Front, upstreams: list[str]) -> None:
    client = await front(upstreams)
    with pytest.raises(openai.BadRequestError) as raised:
        await ask(client, SYSTEM * 40, "Hi?")  # longer than the tiny model's context
    assert raised.value.code == "context_length_exceeded"
    assert all(state["available"] for state in (await per_upstream(client)).values())  # the client's fault


async def test_n_choices_are_one_request_each_on_the_upstream_that_holds_the_prefix(
    front: Front, upstreams: list[str]
) -> None:
    client = await front(upstreams)
    alone = await ask(client, SYSTEM, "What is the capital of France?")
    answer = await ask(client, SYSTEM, "What is the capital of France?", n=3)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert {choice.message.content for choice in answer.choices} == {alone.choices[0].message.content}  # greedy
    assert answer.usage.completion_tokens == 3 * alone.usage.completion_tokens
    assert answer.usage.prompt_tokens == alone.usage.prompt_tokens
    served = {url: state["requests"] for url, state in (await per_upstream(client)).items()}
    assert sorted(served.values()) == [0, 4]  # routed by the prefix, all four to the upstream that holds it
    # The statistics count two requests (each choice's prompt is the first's), and every choice's tokens.
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_requests_total") == 2
    assert sample(metrics, "prefixgate_prompt_tokens_total") == 2 * alone.usage.prompt_tokens
    assert sample(metrics, "prefixgate_generation_tokens_total") == 4 * alone.usage.completion_tokens


async def test_the_upstreams_must_answer_and_serve_the_model_at_start(front: Front, upstreams: list[str]) -> None:
    with pytest.raises(ConfigError, match=f"serve {MODEL}, not 'gpt-4o'; start with --model"):
        await front(upstreams, model="gpt-4o")
    with pytest.raises(ConfigError, match="no upstream answers"):
        await front([f"http://127.0.0.1:{free_port()}/v1"])
    without = upstreams[0].removesuffix("/v1")
    with pytest.raises(ConfigError, match=rf"answered /models with 404 \(is its API under {without}/v1\?\)"):
        await front([without])
