"""The OpenAI-compatible HTTP API on the real app: shapes, streaming, errors, request ids, tenants, disconnects."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import REGISTRY, generate_latest

from prefixgate.errors import StoreError
from prefixgate.store import TieredStore
from tests.proxy.conftest import MODEL, SYSTEM, Serve, engine_of, metric_families, sample, scrape
from tests.proxy.conftest import chat_body as chat


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """Split a server-sent event stream into (event, data) pairs, checking the framing."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = []
    for block in raw.split("\n\n")[:-1]:
        event, data = None, None
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                event = value
            else:
                assert field == "data", f"unexpected line {line!r}"
                data = value
        assert data is not None
        events.append((event, data))
    return events


async def test_chat_completion_has_openai_shape_and_usage(serve: Serve) -> None:
    client = await serve()
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status == 200
    assert response.headers["x-request-id"]
    body = await response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_repeated_prompt_reports_cached_tokens_and_the_same_greedy_answer(serve: Serve) -> None:
    client = await serve()
    first = await (await client.post("/v1/chat/completions", json=chat())).json()
    second = await (await client.post("/v1/chat/completions", json=chat())).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == second["usage"]["prompt_tokens"] - 1  # all but the last token, which starts the answer
    assert second["choices"][0]["message"] == first["choices"][0]["message"]


async def test_a_24h_retention_keeps_the_prompts_blocks_a_day_and_in_memory_leaves_them_to_the_policy(
    serve: Serve,
) -> None:
    client = await serve()
    store = engine_of(client).store
    asked = time.time()
    kept = await client.post("/v1/chat/completions", json=chat(prompt_cache_retention="24h"))
    await engine_of(client).wait_for_blocks()
    prompt_tokens = (await kept.json())["usage"]["prompt_tokens"]
    retained = [entry.retained_until for entry in store.entries(tier="host")]
    day = [until for until in retained if until is not None and asked + 86400 <= until <= time.time() + 86400]
    assert len(day) == prompt_tokens // 8  # every full block of the prompt; none of the answer's
    assert len(retained) > len(day)

    store.flush()
    plain = await client.post("/v1/chat/completions", json=chat(prompt_cache_retention="in_memory"))
    assert plain.status == 200
    await engine_of(client).wait_for_blocks()
    assert {entry.retained_until for entry in store.entries(tier="host")} == {None}


async def test_chat_streaming_sends_role_deltas_finish_usage_then_done(serve: Serve) -> None:
    client = await serve()
    response = await client.post(
        "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}, max_tokens=6)
    )
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await response.text())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] in ("stop", "length")
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    streamed = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[:-1])
    whole = await (await client.post("/v1/chat/completions", json=chat(max_tokens=6))).json()
    assert streamed == whole["choices"][0]["message"]["content"]


async def test_chat_streaming_without_usage_sends_no_usage_chunk(serve: Serve) -> None:
    client = await serve()
    response = await client.post("/v1/chat/completions", json=chat(stream=True))
    chunks = [json.loads(data) for _, data in sse_events(await response.text())[:-1]]
    assert all("usage" not in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


async def test_completions_stream_and_not(serve: Serve) -> None:
    client = await serve()
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}
    whole = await (await client.post("/v1/completions", json=body)).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] >= 1
    response = await client.post("/v1/completions", json={**body, "stream": True})
    events = sse_events(await response.text())
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_the_stop_string_that_ended_an_answer_is_named_in_stop_reason_as_vllm_names_it(
    serve: Serve, route: str
) -> None:
    client = await serve()
    chat_route = route == "/v1/chat/completions"
    body = chat(max_tokens=16) if chat_route else {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 16}
    body["temperature"] = 0

    def text_of(choice: dict[str, Any]) -> str:
        return str(choice["message"]["content"] if chat_route else choice["text"])

    free = (await (await client.post(route, json=body)).json())["choices"][0]
    assert free["stop_reason"] is None  # no stop string ended it
    text = text_of(free)
    stop = text.strip()[2:5]
    assert stop, f"the tiny model's answer is too short to take a stop string from: {text!r}"
    stopped = (await (await client.post(route, json=body | {"stop": ["never said", stop]})).json())["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    assert text_of(stopped) == text[: text.index(stop)]
    response = await client.post(route, json=body | {"stop": [stop], "stream": True})
    chunks = [json.loads(data) for _, data in sse_events(await response.text())[:-1]]
    assert [chunk["choices"][0]["stop_reason"] for chunk in chunks] == [None] * (len(chunks) - 1) + [stop]


def nested(depth: int) -> dict[str, Any]:
    """Return a JSON schema whose properties nest `depth` objects deep."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    ("malformed json", b'{"model": ', 400, None, "not valid JSON"),
    ("json nested past the parser", b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "nests too"),
    (
        "a tool schema nested 100 deep",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(100)}}]),
        400,
        None,
        "at most 64 levels",
    ),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("wrong type", chat(temperature="hot"), 400, "temperature", "temperature"),
    ("missing messages", {"model": MODEL}, 400, "messages", "required"),
    ("empty messages", chat() | {"messages": []}, 400, "messages", "at least 1"),
    ("unknown role", chat() | {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "role"),
    ("max_tokens zero", chat(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    ("temperature too high", chat(temperature=3), 400, "temperature", "less than or equal to 2"),
    ("n above sixteen", chat(n=17), 400, "n", "less than or equal to 16"),
    ("unknown field", chat(frobnicate=True), 400, "frobnicate", "unknown field"),
    ("a lone surrogate", chat("Hi \ud800 there"), 400, "messages.1.content", "lone surrogate (\\ud800)"),
    ("a lone surrogate in a key", chat(metadata={"\udfff": "x"}), 400, "metadata.\udfff", "lone surrogate"),
    ("penalty out of range", chat(frequency_penalty=2.5), 400, "frequency_penalty", "less than or equal to 2"),
    ("logit_bias of a word", chat(logit_bias={"hello": 5}), 400, "logit_bias", "token ids"),
    ("logit_bias past the vocabulary", chat(logit_bias={"99999999": 5}), 400, "logit_bias", "outside this model's"),
    ("top_logprobs without logprobs", chat(top_logprobs=2), 400, "top_logprobs", '"logprobs": true'),
    ("min_tokens past max_tokens", chat(max_tokens=4, min_tokens=5), 400, "min_tokens", "between 0 and max_tokens"),
    ("tool_choice without tools", chat(tool_choice="required"), 400, "tool_choice", "needs tools"),
    ("a vLLM field a local model ignores", chat(guided_regex="[a-z]+"), 400, "guided_regex", "not supported"),
    (
        "stream_options without stream",
        chat(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "only allowed when stream is true",
    ),
    (
        "tool_choice naming a tool not sent",
        chat(
            tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "search"}},
        ),
        400,
        "tool_choice",
        "'search', which is not among the tools ('lookup')",
    ),
    (
        "a schema no grammar can hold an answer to",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}),
        400,
        None,
        "cannot be held to this schema",
    ),
    (
        "a schema too large for the grammar engine",
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}},
            }
        ),
        400,
        None,
        "send a simpler one",
    ),
    (
        "a schema that is no object",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": False}}),
        400,
        "response_format",
        "must be a JSON Schema object, not false",
    ),
    (
        "NaN for a number",
        json.dumps(chat()).replace('"temperature": 0', '"temperature": NaN').encode(),
        400,
        None,
        "NaN is not a JSON number",
    ),
    ("max_tokens as text", chat(max_tokens="2"), 400, "max_tokens", "valid integer"),
    ("max_tokens as a decimal", chat(max_tokens=2.0), 400, "max_tokens", "valid integer"),
    ("stream as text", chat(stream="false"), 400, "stream", "valid boolean"),
    (
        "an image",
        chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        400,
        "messages.1.content",
        "content part 0 is of type 'image_url': this server takes text parts",
    ),
    (
        "an assistant turn of nothing",
        chat(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": []}]),
        400,
        "messages.1",
        "an assistant message needs content or tool_calls",
    ),
    (
        "a user turn's reasoning",
        chat(messages=[{"role": "user", "content": "Hi", "reasoning_content": "Hm."}]),
        400,
        "messages.0",
        "a user message carries no reasoning",
    ),
    ("unknown retention", chat(prompt_cache_retention="1w"), 400, "prompt_cache_retention", "'in_memory' or '24h'"),
    ("seventeen stop strings", chat(stop=[f"stop {i}" for i in range(17)]), 400, "stop", "at most 16 stop strings"),
    ("a stop string of 257 characters", chat(stop=["x" * 257]), 400, "stop", "at most 256 characters"),
    ("prompt too long", chat("word " * 1200), 400, "messages", "context"),
    ("prompt plus max_tokens too long", chat("hi", max_tokens=1020), 400, "max_tokens", "context"),
]


@pytest.mark.parametrize("name, body, status, param, words", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
async def test_bad_input_gets_a_clear_openai_error(
    serve: Serve, name: str, body: Any, status: int, param: str | None, words: str
) -> None:
    client = await serve()
    if isinstance(body, bytes):
        response = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    else:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status == status
    assert response.headers["x-request-id"]
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert words.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param


async def test_a_lone_surrogate_is_a_400_naming_its_field_on_every_face(serve: Serve) -> None:
    client = await serve()
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}],
    }
    response = await client.post("/v1/messages", json=body)
    assert response.status == 400
    error = (await response.json())["error"]
    assert (
        error["type"] == "invalid_request_error"
        and "messages.0.content.0.text holds a lone surrogate" in error["message"]
    )
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "\udc00"})
    assert response.status == 400 and (await response.json())["error"]["param"] == "prompt"
    assert (await client.post("/v1/chat/completions", json=chat("Hi \ud83d\ude00"))).status == 200  # a pair is text


async def test_errors_for_unknown_model_large_body_and_unknown_route(serve: Serve) -> None:
    client = await serve(max_body_bytes=4096)
    response = await client.post("/v1/chat/completions", json=chat(model="gpt-9"))
    assert response.status == 404
    assert (await response.json())["error"]["code"] == "model_not_found"
    response = await client.post("/v1/chat/completions", json=chat("x" * 10_000))
    assert response.status == 413
    assert "larger than 4096 bytes" in (await response.json())["error"]["message"]
    response = await client.get("/v1/nothing-here")
    assert response.status == 404 and "error" in await response.json()
    gzip = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    response = await client.post("/v1/chat/completions", data=json.dumps(chat()).encode(), headers=gzip)
    assert response.status == 400 and response.headers["Connection"] == "close"
    assert "decode content-encoding: gzip" in (await response.json())["error"]["message"]


async def test_the_server_stays_healthy_after_every_bad_input(serve: Serve) -> None:
    client = await serve()
    for _, body, *_ in BAD_REQUESTS:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        await client.post("/v1/chat/completions", **kwargs)
    assert (await client.get("/health")).status == 200
    response = await client.post("/v1/chat/completions", json=chat())
    assert response.status == 200
    stats = engine_of(client).store.stats()
    assert all(tier.corrupt == 0 for tier in stats)


async def test_the_client_request_id_is_echoed_on_plain_streamed_and_error_responses(serve: Serve) -> None:
    client = await serve()
    response = await client.get("/health", headers={"x-request-id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    streamed = await client.post("/v1/chat/completions", json=chat(stream=True), headers={"x-request-id": "abc-456"})
    assert streamed.headers["x-request-id"] == "abc-456"
    await streamed.read()
    refused = await client.post("/v1/chat/completions", json=chat(model="gpt-9"), headers={"x-request-id": "abc-789"})
    assert refused.status == 404 and refused.headers["x-request-id"] == "abc-789"
    generated = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert generated.headers["x-request-id"].startswith("req-")
    await generated.read()


def server_timing(header: str) -> dict[str, float]:
    """Parse a Server-Timing header into milliseconds by metric name."""
    timings = {}
    for metric in header.split(", "):
        name, _, duration = metric.partition(";dur=")
        timings[name] = float(duration.partition(";")[0])
    return timings


async def test_server_timing_gives_the_engine_time_within_the_round_trip(serve: Serve) -> None:
    client = await serve()
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=chat())
    await response.read()
    round_trip_ms = (time.perf_counter() - started) * 1e3
    timings = server_timing(response.headers["Server-Timing"])
    assert set(timings) == {"ttft", "engine", "saved"}
    assert 0 < timings["ttft"] <= timings["engine"] < round_trip_ms

    # A stream's headers leave before its end: they carry the time to the first token only.
    streamed = await client.post("/v1/chat/completions", json=chat(stream=True))
    await streamed.read()
    assert set(server_timing(streamed.headers["Server-Timing"])) == {"ttft", "saved"}


async def test_the_prefill_the_cache_spares_is_estimated_and_summed(serve: Serve) -> None:
    client = await serve(admin_key="sk-admin", metrics_tenants=True, prices={MODEL: "1.5,0.25,2,6"})
    cold = await client.post("/v1/chat/completions", json=chat())
    warm = await client.post("/v1/chat/completions", json=chat())
    cached = (await warm.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert 'saved;dur=0.000;desc="prefill spared by the cache (estimate)"' in cold.headers["Server-Timing"]
    saved = server_timing(warm.headers["Server-Timing"])["saved"] / 1e3  # seconds
    assert saved > 0  # the cold request's own prefill measured the rate; its cached tokens at that rate
    report = await (await client.get("/admin/cache", headers={"Authorization": "Bearer sk-admin"})).json()
    assert report["totals"]["prefill_seconds_saved"] == pytest.approx(saved, abs=1e-3)
    assert [tenant["prefill_seconds_saved"] for tenant in report["tenants"]] == [
        report["totals"]["prefill_seconds_saved"]
    ]
    usage = [(await response.json())["usage"] for response in (cold, warm)]
    prompt = sum(u["prompt_tokens"] for u in usage)
    completion = sum(u["completion_tokens"] for u in usage)
    totals = report["totals"]
    assert totals["cost_saved"] == pytest.approx(cached * (1.5 - 0.25) / 1e6, abs=1e-6)  # rounded to 6 places
    assert totals["cost"] == pytest.approx(((prompt - cached) * 1.5 + cached * 0.25 + completion * 6) / 1e6, abs=1e-6)
    assert report["tenants"][0]["cost_saved"] == totals["cost_saved"]
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_cost_saved_total") == pytest.approx(totals["cost_saved"], abs=1e-6)
    assert sample(metrics, "prefixgate_tenant_cost_saved_total", tenant="") == pytest.approx(
        totals["cost_saved"], abs=1e-6
    )
    assert sample(metrics, "prefixgate_prefill_seconds_saved_total") == pytest.approx(saved, abs=1e-5)
    assert sample(metrics, "prefixgate_tenant_prefill_seconds_saved_total", tenant="") == pytest.approx(saved, abs=1e-5)


async def test_models_health_and_metrics(serve: Serve) -> None:
    client = await serve()
    models = await (await client.get("/v1/models")).json()
    assert [model["id"] for model in models["data"]] == [MODEL]
    assert models["data"][0]["context_length"] == models["data"][0]["max_model_len"] == 1024
    assert await (await client.get(f"/v1/models/{MODEL}")).json() == models["data"][0]
    missing = await client.get("/v1/models/org/other-model")
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "model_not_found"
    await client.post("/v1/chat/completions", json=chat())
    await client.post("/v1/chat/completions", json=chat())
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_requests_total", model_name=MODEL) == 2
    assert sample(metrics, "prefixgate_time_to_first_token_seconds_count", model_name=MODEL) == 2
    assert sample(metrics, "prefixgate_time_to_first_token_seconds_bucket", le="+Inf") == 2
    # The second request found the first one's prompt in the cache: some of its tokens, never more than were asked.
    queries = sample(metrics, "prefixgate_prefix_cache_queries_total", model_name=MODEL)
    hits = sample(metrics, "prefixgate_prefix_cache_hits_total", model_name=MODEL)
    assert 0 < hits <= queries == sample(metrics, "prefixgate_prompt_tokens_total")
    assert sample(metrics, "prefixgate_prefix_cache_hits_by_tier_total", tier="host") == hits
    assert sample(metrics, "prefixgate_generation_tokens_total") > 0
    assert sample(metrics, "prefixgate_num_requests_running") == sample(metrics, "prefixgate_num_requests_waiting") == 0
    assert sample(metrics, "prefixgate_store_entries", tier="host") > 0
    # Each app has a registry of its own: nothing lands in prometheus_client's process-wide one.
    assert "prefixgate_" not in generate_latest(REGISTRY).decode()


async def test_api_keys_map_to_tenants_that_never_share_blocks(serve: Serve) -> None:
    client = await serve(api_keys={"key-a": "acme", "key-b": "globex"}, metrics_tenants=True)
    assert (await client.post("/v1/chat/completions", json=chat())).status == 401
    bad = await client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer nope"})
    assert bad.status == 401 and (await bad.json())["error"]["code"] == "invalid_api_key"

    async def cached(key: str, **fields: Any) -> int:
        response = await client.post(
            "/v1/chat/completions", json=chat(**fields), headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status == 200
        return int((await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached("key-a") == 0
    assert await cached("key-a") > 0  # same tenant hits
    assert await cached("key-b") == 0  # another tenant misses
    assert await cached("key-a", cache_salt="project-x") == 0  # a salt splits one tenant's cache
    assert await cached("key-a", cache_salt="project-x") > 0
    assert (await client.get("/health")).status == 200  # health needs no key
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_tenant_requests_total", tenant="acme") == 4
    assert sample(metrics, "prefixgate_tenant_requests_total", tenant="globex") == 1
    assert sample(metrics, "prefixgate_tenant_cached_tokens_total", tenant="globex") == 0
    assert sample(metrics, "prefixgate_tenant_cached_tokens_total", tenant="acme") > 0


async def test_metrics_name_no_tenant_unless_configured_to(serve: Serve) -> None:
    client = await serve(api_keys={"key-a": "acme"})
    response = await client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer key-a"})
    assert response.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert sample(metric_families(metrics), "prefixgate_requests_total") == 1
    assert "acme" not in metrics and "prefixgate_tenant_" not in metrics


async def test_layout_moves_a_date_out_of_the_system_prompt_and_can_be_turned_off(serve: Serve) -> None:
    client = await serve()

    def dated(day: str, **fields: Any) -> dict[str, Any]:
        body = chat(**fields)
        body["messages"][0]["content"] = f"Today is 2026-11-{day}. " + SYSTEM
        return body

    first = await client.post("/v1/chat/completions", json=dated("28"))
    assert first.headers["x-prefixgate-layout-moved"] == "date@0:9"
    second = await client.post("/v1/chat/completions", json=dated("29"))
    laid_out_hit = (await second.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert laid_out_hit > 24  # past the date, into the rest of the system prompt
    await client.post("/v1/chat/completions", json=dated("28", layout=False))
    off = await client.post("/v1/chat/completions", json=dated("30", layout=False))
    assert "x-prefixgate-layout-moved" not in off.headers
    # In place, the date splits the prefix: only the tokens before its day can match.
    assert (await off.json())["usage"]["prompt_tokens_details"]["cached_tokens"] < 24


async def test_an_error_after_streaming_began_is_an_sse_error_event(serve: Serve) -> None:
    client = await serve()
    response = await client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=400))
    await response.content.readline()
    await engine_of(client).backend.aclose()  # the model goes away mid-stream
    events = sse_events((await response.content.read()).decode().split("\n", 1)[1].lstrip("\n"))
    errors = [json.loads(data) for event, data in events if event == "error"]
    assert len(errors) == 1 and errors[0]["error"]["message"]
    assert events[-1] == (None, "[DONE]")


async def test_health_is_reachable_before_any_request(serve: Serve) -> None:
    client: TestClient[Any, Any] = await serve()
    body = await (await client.get("/health")).json()
    assert body == {"status": "ok", "model": MODEL, "prefix_reuse": True, "steps": "eager"}


class UnreadableStore(TieredStore):
    """A store whose reads fail, as one on a failing disk would."""

    def fetch(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreError("LMDB read failed: Input/output error")


async def test_a_store_failure_is_a_server_error_logged_with_the_request_id(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    client = await serve()
    engine_of(client).store.__class__ = UnreadableStore
    response = await client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "req-disk-1"})
    assert response.status == 500
    error = (await response.json())["error"]
    assert error["type"] == "server_error" and "LMDB" not in error["message"]  # the details are the server's
    assert "request req-disk-1 failed: StoreError: LMDB read failed" in caplog.text


async def test_each_request_is_logged_once_with_its_tenant_status_and_tokens(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    client = await serve(api_keys={"key-a": "acme"})
    key = {"Authorization": "Bearer key-a"}
    with caplog.at_level(logging.DEBUG, logger="prefixgate.requests"):
        await (await client.post("/v1/chat/completions", json=chat(), headers={**key, "x-request-id": "r-1"})).read()
        second = await client.post("/v1/chat/completions", json=chat(stream=True), headers=key)
        await second.read()
        await (await client.post("/v1/chat/completions", json=chat(model="gpt-9"), headers=key)).read()
        await (await client.get("/health")).read()
    records = [r for r in caplog.records if r.name == "prefixgate.requests"]
    fields = [getattr(record, "fields") for record in records]  # noqa: B009  # set through `extra`
    assert [(f["path"], f["status"]) for f in fields] == [
        ("/v1/chat/completions", 200),
        ("/v1/chat/completions", 200),
        ("/v1/chat/completions", 404),
        ("/health", 200),
    ]
    first, streamed, refused, health = fields
    assert first["request_id"] == "r-1" and first["tenant"] == "acme"
    assert first["prompt_tokens"] == streamed["prompt_tokens"] > 0 and first["cached_tokens"] == 0
    assert streamed["cached_tokens"] > 0 and streamed["request_id"] == second.headers["x-request-id"]
    assert first["completion_tokens"] > 0 and first["ttft_ms"] > 0
    assert "prompt_tokens" not in refused and "prompt_tokens" not in health
    assert [record.levelno for record in records] == [logging.INFO] * 3 + [logging.DEBUG]
    message = records[0].getMessage()
    assert message.startswith("request_id=r-1 tenant=acme method=POST path=/v1/chat/completions status=200")
    assert f"cached_tokens=0 completion_tokens={first['completion_tokens']}" in message
