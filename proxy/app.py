"""The aiohttp app: OpenAI-compatible routes over the engine. Handlers parse, call the engine, render."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from prefixgate.backends import HFBackend, TokenChunk
from prefixgate.backends.router import Upstream
from prefixgate.backends.tool_calls import call_id
from prefixgate.backends.upstream import UpstreamConfig, UpstreamError
from prefixgate.errors import (
    ContextLengthError,
    ModelStoppedError,
    OverloadedError,
    PrefixgateError,
    RequestError,
    UnsupportedModelError,
)
from prefixgate.proxy import anthropic_api as anthropic
from prefixgate.proxy import openai_api as api
from prefixgate.proxy import responses_api
from prefixgate.proxy.answer import Answer, assemble
from prefixgate.proxy.body import OFF_LOOP_BYTES, let_go, off_loop, parsed
from prefixgate.proxy.choices import AnyEngine, AnyGeneration, Choices
from prefixgate.proxy.engine import Engine, PromptRequest, Usage
from prefixgate.proxy.layout import DEFAULT_PATTERNS, DynamicPattern, describe
from prefixgate.proxy.settings import Settings
from prefixgate.proxy.statistics import EngineCollector
from prefixgate.proxy.upstream_engine import UpstreamEngine
from prefixgate.store import BlockLayout, RemoteConfig, StoreConfig, TierConfig, TieredStore
from prefixgate.store.keys import load_or_create_secret
from prefixgate.threads import torch_executor

log = logging.getLogger(__name__)
request_log = logging.getLogger("prefixgate.requests")  # one line per request; its fields ride on the record

ENGINE: web.AppKey[AnyEngine] = web.AppKey("engine")
METRICS = web.AppKey("metrics", CollectorRegistry)
SETTINGS = web.AppKey("settings", Settings)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
CHOICES: web.RequestKey[Choices] = web.RequestKey("choices")  # the request's generations, for its log line
# How the app is served (keyword arguments of aiohttp's run_app, AppRunner and TestServer): a client that disconnects
# cancels its handler, so its request stops at the model's next step, in prefill as in decoding, streamed or not.
SERVE_OPTIONS: dict[str, Any] = {"handler_cancellation": True}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
EngineFactory = Callable[[Settings], Awaitable[AnyEngine]]


async def build_engine(settings: Settings) -> AnyEngine:
    """Load the model named in the settings, open the store beside it, and join them in an engine; or, with
    upstreams, an engine in front of them."""
    patterns = (
        tuple(DynamicPattern(name, regex) for name, regex in settings.layout_patterns.items())
        if settings.layout_patterns is not None
        else DEFAULT_PATTERNS
    )
    if settings.upstream:
        # The tenants' salts outlive a restart with the store's secret, so the upstreams' caches stay theirs.
        folder = settings.store
        secret = await asyncio.to_thread(load_or_create_secret, folder) if folder is not None else os.urandom(32)
        configs = [UpstreamConfig(url, settings.upstream_api_keys.get(url)) for url in settings.upstream]
        return await UpstreamEngine.open(
            configs,
            settings.model,
            secret=secret,
            patterns=patterns,
            layout=settings.layout,
            balance=settings.upstream_balance,
            check_interval=settings.upstream_check_interval,
        )
    backend = await asyncio.to_thread(
        HFBackend.load,
        settings.model,
        dtype=None if settings.dtype == "auto" else settings.dtype,
        compile_steps="auto" if settings.compile == "auto" else settings.compile == "on",
        block_size=settings.block_size,
        model_cache_dir=settings.model_cache_dir,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        interleaved_prefill_tokens=settings.interleaved_prefill_tokens,
        kv_memory_budget=None if settings.kv_memory_budget is None else int(settings.kv_memory_budget),
        max_running=settings.max_running,
        max_waiting=settings.max_waiting,
        kv_buffer_budget=int(settings.kv_buffer_budget),
    )
    geometry = backend.geometry
    try:
        store = await asyncio.to_thread(
            TieredStore.open,
            settings.store,
            BlockLayout(geometry.block_shape, geometry.dtype),
            store_config(settings, backend.device),
            device=backend.device,
        )
    except BaseException:
        await backend.aclose()
        raise
    return Engine(backend, store, patterns=patterns, layout=settings.layout)


def store_config(settings: Settings, device: torch.device) -> StoreConfig:
    """Return the store's tiers as the settings give them, for a model on `device`."""
    defaults = StoreConfig.defaults(device)
    device_bytes = defaults.device.capacity_bytes if settings.device_budget is None else int(settings.device_budget)
    policy = {"policy": settings.policy, "ttl": settings.ttl, "idle_ttl": settings.idle_ttl}
    remote = (
        RemoteConfig(
            tuple(settings.remote),
            ttl=settings.remote_ttl,
            timeout=settings.remote_timeout,
            queue_bytes=int(settings.remote_queue_budget),
        )
        if settings.remote
        else None
    )
    return StoreConfig(
        device=TierConfig(device_bytes, **policy),  # type: ignore[arg-type]
        host=TierConfig(int(settings.host_budget), **policy),  # type: ignore[arg-type]
        disk=TierConfig(int(settings.disk_budget), **policy),  # type: ignore[arg-type]
        remote=remote,
    )


def create_app(settings: Settings, engine_factory: EngineFactory = build_engine) -> web.Application:
    """Build the app; the engine is made by `engine_factory` at startup and closed at cleanup."""
    app = web.Application(
        client_max_size=int(settings.max_body_bytes),
        middlewares=[_request_ids, _log_requests, _errors, _tenants],
    )
    app[SETTINGS] = settings
    app.on_response_prepare.append(_send_request_id)

    async def engine_context(app: web.Application) -> AsyncIterator[None]:
        app[ENGINE] = await engine_factory(settings)
        app[METRICS] = _metrics_registry(app[ENGINE], settings)
        # The model is loaded: from now on the loop's worker threads, which prepare prompts and copy blocks, run
        # torch on one CPU thread and make no OpenMP pool beside the model thread's (see prefixgate.threads).
        asyncio.get_running_loop().set_default_executor(torch_executor("prefixgate-io"))
        yield
        await app[ENGINE].close()

    app.cleanup_ctx.append(engine_context)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # a model id may hold a slash: "org/name"
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    # Imported here, not at the top: the admin app builds on this module's keys, so it imports this module.
    from prefixgate.proxy.admin import add_admin

    add_admin(app)
    return app


# -- handlers -----------------------------------------------------------------------------------------------------

Body = api.ChatCompletionRequest | api.CompletionRequest | anthropic.MessagesRequest | responses_api.ResponsesRequest


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _generate(request, await parsed(await request.read(), api.ChatCompletionRequest), chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _generate(request, await parsed(await request.read(), api.CompletionRequest), chat=False)


async def _generate(
    request: web.Request, body: api.ChatCompletionRequest | api.CompletionRequest, *, chat: bool
) -> web.StreamResponse:
    param = "messages" if chat else "prompt"
    choices = await _start(request, body.model, await _prompt(request, body), prompt_param=param, n=body.n)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # From the response's first byte on: a client that leaves as it is prepared still stops the generation.
        async with choices:
            return await _stream(request, choices, body.model, include_usage, chat=chat)
    chunks: list[list[TokenChunk]] = [[] for _ in choices.generations]
    async with choices:
        async for index, chunk in choices.chunks():
            chunks[index].append(chunk)
    render = api.chat_completion if chat else api.text_completion
    answers = [(assemble(each), g.finish_reason or "stop") for each, g in zip(chunks, choices.generations, strict=True)]
    first = choices.first
    payload = render(first.request_id, body.model, answers, choices.usage(), first.system_fingerprint)
    return web.json_response(payload, headers=_headers(first))


async def _prompt(request: web.Request, body: Body) -> PromptRequest:
    """Return the engine's request for a body: off the loop for a large one, as the body was parsed (400,000
    messages take a third of a second to translate)."""
    if (request.content_length or 0) <= OFF_LOOP_BYTES:
        return body.to_prompt_request(request[TENANT])
    return await off_loop(_translated, body, request[TENANT])


def _translated(body: Body, tenant: str) -> PromptRequest:
    """Return the engine's request for a large body, and let go of the body's own copy of the prompt here, in the
    worker thread: freed on the loop when the request ends, 400,000 messages would hold it 80 ms."""
    prompt = body.to_prompt_request(tenant)
    for name in ("messages", "input", "tools"):
        if isinstance(items := getattr(body, name, None), list):
            let_go(items)
    return prompt


def _let_go_of(prompt: PromptRequest) -> None:
    for items in (prompt.messages, prompt.tools):
        if items is not None:
            let_go(items)


async def _start(request: web.Request, model: str, prompt: PromptRequest, *, prompt_param: str, n: int = 1) -> Choices:
    """Start the request's `n` generations on the engine serving `model`, each up to its first token; an error about
    the engine's prompt names the field the body sent it in, `prompt_param`."""
    try:
        choices = await Choices.start(_engine_for(request, model), prompt, n)
    except BaseException as error:
        if isinstance(error, RequestError) and error.param == "prompt":
            error.param = prompt_param  # the engine's prompt is the chat APIs' messages, the Responses API's input
        if (request.content_length or 0) > OFF_LOOP_BYTES:
            # A large prompt is refused (it cannot fit any context): its messages are let go of in the worker thread,
            # not on the loop as the error unwinds (400,000 messages would hold it for tens of milliseconds).
            await off_loop(_let_go_of, prompt)
        raise
    request[CHOICES] = choices
    return choices


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: Anthropic's Messages API on the same engine."""
    body = await parsed(await request.read(), anthropic.MessagesRequest)
    if body.max_tokens == 0:
        return await _prewarm(request, body)
    choices = await _start(request, body.model, await _prompt(request, body), prompt_param="messages")
    generation = choices.first  # the Messages API answers once
    message_id = anthropic.message_id()
    if body.stream:
        async with choices:
            return await _stream_message(request, generation, body.model, message_id)
    async with choices:
        answer = assemble([chunk async for chunk in generation])
    payload = anthropic.message(message_id, body.model, answer, generation.finish_reason, generation.usage())
    return web.json_response(payload, headers=_headers(generation))


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: OpenAI's Responses API on the same engine, stateless (see `responses_api`)."""
    body = await parsed(await request.read(), responses_api.ResponsesRequest)
    choices = await _start(request, body.model, await _prompt(request, body), prompt_param="input")
    generation = choices.first  # the Responses API answers once
    rid, created = responses_api.response_id(), float(int(time.time()))
    if body.stream:
        async with choices:
            return await _stream_response(request, generation, body, rid, created)
    async with choices:
        chunks = [chunk async for chunk in generation]
    items = responses_api.output_items(assemble(chunks))
    thought = sum(1 for chunk in chunks if chunk.reasoning)
    usage = generation.usage()
    payload = responses_api.response(body, rid, created, items, generation.finish_reason, usage, thought)
    return web.json_response(payload, headers=_headers(generation))


async def _prewarm(request: web.Request, body: anthropic.MessagesRequest) -> web.Response:
    """Answer `max_tokens: 0`: compute and store the prompt (its breakpoints kept as asked), generate nothing."""
    if body.stream:
        raise RequestError("max_tokens 0 fills the cache and answers nothing: send it without stream", param="stream")
    engine = _engine_for(request, body.model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError(
            "max_tokens 0 fills a cache of this server's own, and this one forwards to upstreams", param="max_tokens"
        )
    warmed = await engine.warm(await _prompt(request, body))
    usage = Usage(warmed.prompt_tokens, 0, warmed.read_tokens, {}, warmed.cache_writes)
    empty = Answer("", "", "", (), (), None)
    return web.json_response(anthropic.message(anthropic.message_id(), body.model, empty, "length", usage))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens of a Messages body, as this server renders it."""
    body = await parsed(await request.read(), anthropic.CountTokensRequest)
    engine = _engine_for(request, body.model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError("counting tokens needs the model's tokenizer, and this server forwards to upstreams")
    prepared = await engine.prepare(await _prompt(request, body))
    return web.json_response({"input_tokens": len(prepared.token_ids)})


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[ENGINE])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the one model this server serves, or 404 (the `openai` client's models.retrieve)."""
    return web.json_response(_model_card(_engine_for(request, request.match_info["model"])))


async def health(request: web.Request) -> web.Response:
    """GET /health: "ok"; "degraded" while a store tier fails (naming it and its last error), the remote tier, or
    some upstream, does not answer (requests go on without it); 503 "unavailable" once the model has stopped, or
    while no upstream answers."""
    engine = request.app[ENGINE]
    if isinstance(engine, UpstreamEngine):
        return _upstream_health(engine)
    body: dict[str, Any] = {
        "status": "ok",
        "model": engine.backend.model_id,
        "prefix_reuse": engine.backend.prefix_reuse,
        "steps": engine.backend.steps,
    }
    problem = engine.backend.problem()
    if problem is not None:
        return web.json_response(body | {"status": "unavailable", "problem": problem}, status=503)
    failing = {tier.name: tier.problem for tier in engine.store.tiers if tier.problem is not None}
    if failing:  # requests are still served, from the other tiers and the model
        body |= {"status": "degraded", "tiers": failing}
    remote = engine.store.remote
    if remote is not None:
        available = await asyncio.to_thread(remote.check)
        body["remote"] = {"url": remote.url, "available": available}
        if not available:  # requests are still served, from the local tiers and the model
            body["status"] = "degraded"
    return web.json_response(body)


def _upstream_health(engine: UpstreamEngine) -> web.Response:
    """Each upstream's state; "degraded" while some are out of rotation, 503 "unavailable" while all are."""
    upstreams = [upstream_state(upstream) for upstream in engine.pool.router.upstreams]
    healthy = sum(state["available"] for state in upstreams)
    status = "ok" if healthy == len(upstreams) else "degraded" if healthy else "unavailable"
    body = {"status": status, "model": engine.model_id, "upstreams": upstreams}
    return web.json_response(body, status=503 if status == "unavailable" else 200)


def upstream_state(upstream: Upstream) -> dict[str, Any]:
    """Return what `/health` and `/admin/cache` say of one upstream."""
    return {
        "url": upstream.url,
        "available": upstream.failures == 0,
        "in_flight": upstream.in_flight,
        "requests": upstream.requests,
        "failures": upstream.failures,
        "prompt_tokens": upstream.prompt_tokens,
        "cached_tokens": upstream.cached_tokens,
    }


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics, in Prometheus text format."""
    # Off the loop: a scrape reads the store's tiers, and that touches LMDB.
    body = await asyncio.to_thread(generate_latest, request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- rendering ----------------------------------------------------------------------------------------------------


async def _stream(
    request: web.Request, choices: Choices, model: str, include_usage: bool, *, chat: bool
) -> web.StreamResponse:
    """Send the choices as server-sent events, exactly as OpenAI does, each chunk one choice's (by its index) as it
    comes; the caller closes the choices."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_headers(choices.first)}
    )
    await response.prepare(request)
    created = int(time.time())
    first = choices.first
    rid = first.request_id
    kind = "chat.completion.chunk" if chat else "text_completion"

    # each choice's characters of the tokens with log probabilities sent so far: a text chunk's text_offset
    offsets = [0] * len(choices.generations)

    def chunk(
        index: int,
        token: TokenChunk | None,
        finish_reason: str | None = None,
        stop: str | None = None,
        *,
        role: bool = False,
    ) -> dict[str, Any]:
        logprobs = token.logprobs if token is not None else ()
        if not chat:
            text = token.text if token is not None else ""
            body = api.text_chunk(rid, model, created, text, finish_reason, stop, logprobs, offsets[index], index)
            offsets[index] += sum(len(entry.token) for entry in logprobs)
        else:
            delta = api.chat_delta(token) if token is not None else {}
            delta = {"role": "assistant", "content": ""} if role else delta
            body = api.chat_chunk(rid, model, created, delta, finish_reason, stop, logprobs, index)
            if include_usage:
                body["usage"] = None
        fingerprint = first.system_fingerprint  # an upstream's, once it has sent one
        return body | ({"system_fingerprint": fingerprint} if fingerprint is not None else {})

    try:
        if chat:
            for index in range(len(choices.generations)):
                await _send(response, chunk(index, None, role=True))
        async for index, token in choices.chunks():
            if token.text or token.reasoning or token.refusal or token.tool_calls or token.logprobs:
                await _send(response, chunk(index, token))
            if token.finish_reason is not None:  # the choice's last chunk
                await _send(response, chunk(index, None, token.finish_reason, token.stop_sequence))
        for index, generation in enumerate(choices.generations):
            if generation.finish_reason is None:  # an upstream's answer that ended without one: its last chunk still
                await _send(response, chunk(index, None))
        if include_usage:
            await _send(response, api.usage_chunk(rid, model, created, kind, choices.usage()))
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left request %s; generation stopped", rid)  # the caller's aclose() stops the model
        raise
    except Exception as error:
        _, body = _streaming_failure(rid, error)
        await _event(response, "error", body)
    await choices.aclose()  # usage and timing are final before the stream's end
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _stream_message(
    request: web.Request, generation: AnyGeneration, model: str, message_id: str
) -> web.StreamResponse:
    """Send the generation as Anthropic's stream events, in Anthropic's order; the caller closes the generation."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_headers(generation)}
    )
    await response.prepare(request)
    start = anthropic.message(message_id, model, None, None, generation.usage())
    await _event(response, "message_start", {"type": "message_start", "message": start})
    await _event(response, "ping", {"type": "ping"})
    blocks = _ContentBlocks(response)

    async def fail(status: int, message: str) -> None:
        await _event(response, "error", anthropic.error_body(status, message))

    if not await _relay(response, generation, message_id, blocks.add, fail):
        return response
    await blocks.close()
    await generation.aclose()  # usage is final
    stop = blocks.stop
    reason = anthropic.stop_reason(generation.finish_reason, stop)
    usage = anthropic.usage_body(generation.usage())
    end: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop}}
    await _event(response, "message_delta", end | {"usage": usage})
    await _event(response, "message_stop", {"type": "message_stop"})
    await response.write_eof()
    return response


async def _relay(
    response: web.StreamResponse,
    generation: AnyGeneration,
    rid: str,
    send: Callable[[TokenChunk], Awaitable[None]],
    fail: Callable[[int, str], Awaitable[None]],
) -> bool:
    """Send each of the generation's chunks with `send`; return whether it ended well. One that failed has its error
    sent with `fail` (its status and message) and the stream ended; a client that left stops the request."""
    try:
        async for token in generation:
            await send(token)
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left request %s; generation stopped", rid)  # the caller's aclose() stops the model
        raise
    except Exception as error:
        status, body = _streaming_failure(rid, error)
        await fail(status, body["error"]["message"])
        await response.write_eof()
        return False
    return True


class _ContentBlocks:
    """Anthropic's content blocks of a streamed answer, each opened as its content starts and closed before the next:
    reasoning as thinking, text, and each tool call as tool_use, its arguments as input_json_delta pieces."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._index = -1
        self._open: str | int | None = None  # "thinking", "text", or the index of the tool call being streamed
        self.stop: str | None = None  # the stop string that ended the answer, once one has

    async def add(self, token: TokenChunk) -> None:
        """Send what one of the engine's chunks carries."""
        self.stop = token.stop_sequence
        if token.reasoning:
            await self._delta(
                "thinking",
                {"type": "thinking", "thinking": "", "signature": ""},
                {"type": "thinking_delta", "thinking": token.reasoning},
            )
        if token.text:
            await self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": token.text})
        for piece in token.tool_calls:
            block = anthropic.tool_use(piece.id or call_id(), piece.name or "", "{}")
            delta = {"type": "input_json_delta", "partial_json": piece.arguments} if piece.arguments else None
            await self._delta(piece.index, block, delta)

    async def close(self) -> None:
        """Close the block still open."""
        if self._open is not None:
            await _event(self._response, "content_block_stop", {"type": "content_block_stop", "index": self._index})
            self._open = None

    async def _delta(self, kind: str | int, block: dict[str, Any], delta: dict[str, Any] | None) -> None:
        if kind != self._open:
            await self.close()
            self._index += 1
            self._open = kind
            start = {"type": "content_block_start", "index": self._index, "content_block": block}
            await _event(self._response, "content_block_start", start)
        if delta is not None:
            piece = {"type": "content_block_delta", "index": self._index, "delta": delta}
            await _event(self._response, "content_block_delta", piece)


async def _stream_response(
    request: web.Request,
    generation: AnyGeneration,
    body: responses_api.ResponsesRequest,
    rid: str,
    created: float,
) -> web.StreamResponse:
    """Send the generation as the Responses API's stream events, in their order; the caller closes the generation."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **_headers(generation)}
    )
    await response.prepare(request)
    items = _OutputItems(response)
    begun = {"response": responses_api.response(body, rid, created, [], None, None)}
    await items.event("response.created", begun)
    await items.event("response.in_progress", begun)

    async def fail(status: int, message: str) -> None:
        await items.event(
            "error", {"code": "server_error" if status >= 500 else "invalid_request_error", "message": message}
        )

    if not await _relay(response, generation, rid, items.add, fail):
        return response
    await items.close()
    await generation.aclose()  # usage is final
    usage = generation.usage()
    done = responses_api.response(body, rid, created, items.done, generation.finish_reason, usage, items.thought)
    await items.event(
        "response.completed" if done["status"] == "completed" else "response.incomplete", {"response": done}
    )
    await response.write_eof()
    return response


class _OutputItems:
    """The Responses API's output items of a streamed answer, each added as its content begins and done before the
    next: reasoning, the message's text, and each tool call, its arguments in pieces."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._sequence = 0
        self.done: list[dict[str, Any]] = []  # the items done, in order
        self.thought = 0  # the answer's tokens that carried reasoning
        self._item: dict[str, Any] | None = None  # the item being streamed
        self._kind: str | int | None = None  # "reasoning", "text", or the index of the tool call being streamed
        self._text = ""  # what the item has streamed

    async def event(self, kind: str, body: dict[str, Any]) -> None:
        """Send one event, numbered in the stream."""
        await _event(self._response, kind, {"type": kind, "sequence_number": self._sequence} | body)
        self._sequence += 1

    async def add(self, token: TokenChunk) -> None:
        """Send what one of the engine's chunks carries."""
        if token.reasoning:
            self.thought += 1
            if self._kind != "reasoning":
                await self._begin("reasoning", responses_api.reasoning_item(responses_api.item_id("rs"), ""))
            await self._delta("response.reasoning_text.delta", token.reasoning)
        if token.text:
            if self._kind != "text":
                await self._begin("text", responses_api.message_item(responses_api.item_id("msg"), None, "in_progress"))
            await self._delta("response.output_text.delta", token.text, logprobs=[])
        for piece in token.tool_calls:
            if self._kind != piece.index:
                call = (piece.id or call_id(), piece.name or "", "", "in_progress")
                await self._begin(piece.index, responses_api.call_item(responses_api.item_id("fc"), *call))
            if piece.arguments:
                await self._delta("response.function_call_arguments.delta", piece.arguments)

    async def close(self) -> None:
        """Finish the item still open; an answer with none sends an empty message, as a whole one has."""
        if not self.done and self._item is None:
            await self._begin("text", responses_api.message_item(responses_api.item_id("msg"), None, "in_progress"))
        await self._finish()

    async def _begin(self, kind: str | int, item: dict[str, Any]) -> None:
        await self._finish()
        self._kind, self._item, self._text = kind, item, ""
        where = self._where()
        await self.event("response.output_item.added", {"output_index": where["output_index"], "item": item})
        part = self._part("")
        if part is not None:
            await self.event("response.content_part.added", where | {"content_index": 0, "part": part})

    async def _delta(self, kind: str, delta: str, **extra: Any) -> None:
        self._text += delta
        index = {} if kind == "response.function_call_arguments.delta" else {"content_index": 0}
        await self.event(kind, self._where() | index | {"delta": delta} | extra)

    async def _finish(self) -> None:
        item = self._item
        if item is None:
            return
        where = self._where()
        if item["type"] == "function_call":
            item |= {"arguments": self._text, "status": "completed"}
            done = {"arguments": self._text, "name": item["name"]}
            await self.event("response.function_call_arguments.done", where | done)
        else:
            part = self._part(self._text)
            assert part is not None
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            text: dict[str, Any] = {"text": self._text} | ({"logprobs": []} if item["type"] == "message" else {})
            await self.event(kind, where | {"content_index": 0} | text)
            await self.event("response.content_part.done", where | {"content_index": 0, "part": part})
            item["content"] = [part]
            if item["type"] == "message":
                item["status"] = "completed"
        await self.event("response.output_item.done", {"output_index": where["output_index"], "item": item})
        self.done.append(item)
        self._item, self._kind = None, None

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.done)}

    def _part(self, text: str) -> dict[str, Any] | None:
        """Return the item's content part holding `text`: none for a tool call."""
        assert self._item is not None
        if self._item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        if self._item["type"] == "message":
            return responses_api.output_text(text)
        return None


def _streaming_failure(request_id: str, error: Exception) -> tuple[int, dict[str, Any]]:
    """Return the status and OpenAI error body of an error raised after a stream began; log what is the server's."""
    if isinstance(error, PrefixgateError):
        status, body = _error_response(error)
        if status >= 500:
            log.error("request %s failed while streaming: %s: %s", request_id, type(error).__name__, error)
        return status, body
    log.exception("request %s failed while streaming", request_id)  # called in the handler's except: it has the trace
    return 500, api.error_body("internal error while generating; see the server log", "server_error")


async def _event(response: web.StreamResponse, name: str, body: dict[str, Any]) -> None:
    await response.write(f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode())


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode())


def _headers(generation: AnyGeneration) -> dict[str, str]:
    # Server-Timing: the engine's own time, so a client can tell it from the network's and the proxy's.
    # `saved` is not time spent: the prefill the cache spared, estimated at the model's measured rate.
    timings = [
        ("ttft", generation.time_to_first_token, ""),
        ("engine", generation.duration, ""),
        ("saved", generation.saved_seconds, ';desc="prefill spared by the cache (estimate)"'),
    ]
    headers = {
        "Server-Timing": ", ".join(
            f"{name};dur={seconds * 1e3:.3f}{description}"
            for name, seconds, description in timings
            if seconds is not None
        ),
    }
    if generation.cached_tokens is not None:  # an upstream says it with its usage, after a stream's headers
        headers["x-prefixgate-cached-tokens"] = str(generation.cached_tokens)
    if generation.moved:
        headers["x-prefixgate-layout-moved"] = describe(generation.moved)
    return headers


# -- parsing and the edge -----------------------------------------------------------------------------------------


def _engine_for(request: web.Request, model: str) -> AnyEngine:
    engine = request.app[ENGINE]
    if model != engine.model_id:
        raise ModelNotServed(model, engine.model_id)
    return engine


def local_engine(request: web.Request) -> Engine:
    """Return the engine of a local model; raise RequestError in front of upstreams, which hold no cache here."""
    engine = request.config_dict[ENGINE]
    if isinstance(engine, UpstreamEngine):
        raise RequestError(
            f"{request.path} works on this server's own cache, and this one forwards to upstreams, each with its own"
        )
    return engine


def _metrics_registry(engine: AnyEngine, settings: Settings) -> CollectorRegistry:
    """Return a registry of the app's own that reads the engine's statistics at each scrape."""
    # One per app, not prometheus_client's process-wide default: several apps in one process each report their own.
    registry = CollectorRegistry()
    if isinstance(engine, UpstreamEngine):
        collector = EngineCollector(
            engine.stats,
            model_name=engine.model_id,
            upstreams=lambda: engine.pool.router.upstreams,
            tenants=settings.metrics_tenants,
            prices=settings.prices.get(engine.model_id),
        )
    else:
        collector = EngineCollector(
            engine.stats,
            engine.store.stats,
            engine.backend.admission,
            model_name=engine.model_id,
            remote=engine.store.remote_stats,
            tenants=settings.metrics_tenants,
            prices=settings.prices.get(engine.model_id),
        )
    registry.register(collector)
    return registry


def _model_card(engine: AnyEngine) -> dict[str, Any]:
    card = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "prefixgate"}
    return card | ({"context_length": engine.context_length} if engine.context_length is not None else {})


class ModelNotServed(PrefixgateError, LookupError):
    """A request names a model this server does not serve."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"the model {asked!r} does not exist here; this server serves {served!r}")


@web.middleware
async def _request_ids(request: web.Request, handler: Handler) -> web.StreamResponse:
    request[REQUEST_ID] = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
    return await handler(request)


@web.middleware
async def _log_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Log one line per request: its id, tenant, route and status, and for a generation its tokens and times."""
    started = time.perf_counter()
    status = 500  # an exception no middleware made into a response
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:
        status = error.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client left before its answer was done (nginx's code for it)
        raise
    finally:
        fields = _request_fields(request, status, time.perf_counter() - started)
        text = " ".join(f"{name}={value}" for name, value in fields.items() if value is not None)
        # Load balancers poll /health and scrapers /metrics every few seconds: their lines are for debugging.
        quiet = request.path in ("/health", "/metrics")
        request_log.log(logging.DEBUG if quiet else logging.INFO, text, extra={"fields": fields})


def _request_fields(request: web.Request, status: int, seconds: float) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "request_id": request.get(REQUEST_ID),
        "tenant": request.get(TENANT) or None,
        "method": request.method,
        "path": request.path,
        "status": status,
        "ms": round(seconds * 1e3, 1),
    }
    choices = request.get(CHOICES)
    if choices is not None:
        usage, ttft = choices.usage(), choices.first.time_to_first_token
        fields |= {
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "completion_tokens": usage.completion_tokens,
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
        }
    return fields


async def _send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Put the request's id on its response as its headers go out."""
    # A signal, not the middleware: a streamed response is prepared by its handler, before any middleware sees it.
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OverloadedError as error:
        body = api.error_body(str(error), "rate_limit_error", code="server_overloaded")
        return _error_reply(request, 429, body, headers={"Retry-After": str(error.retry_after)})
    except PrefixgateError as error:
        status, body = _error_response(error)
        if status >= 500:
            log.error("request %s failed: %s: %s", request.get(REQUEST_ID), type(error).__name__, error)
        return _error_reply(request, status, body)
    except ValidationError as error:
        problems = error.errors()
        param = ".".join(str(part) for part in problems[0]["loc"]) if problems else None
        message = "; ".join(_describe_problem(problem) for problem in problems)
        return _error_reply(request, 400, api.error_body(message, "invalid_request_error", param=param))
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        message = f"the request body is larger than {limit} bytes; send a smaller one (max_body_bytes)"
        return _error_reply(request, 413, api.error_body(message, "invalid_request_error"))
    except RequestPayloadError as error:  # a body that does not decode as its Content-Encoding says, or cut short
        # Nothing more is read from this connection, which then closes: aiohttp would otherwise read on, meet the
        # error again and log it, and what follows in the stream is no request.
        request.content.feed_eof()
        reason = str(error).strip().splitlines()[-1].strip()
        message = f"the request body could not be read ({reason}); send it as its Content-Encoding header says"
        reply = _error_reply(request, 400, api.error_body(message, "invalid_request_error"))
        reply.force_close()
        return reply
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = f"{request.method} {request.path}: {error.reason}"
        code = "not_found" if error.status == 404 else None
        return _error_reply(request, error.status, api.error_body(message, "invalid_request_error", code=code))
    except ConnectionResetError:
        raise  # the client left: nobody to answer, and no fault of the server's
    except Exception:
        log.exception("request %s failed", request.get(REQUEST_ID))
        body = api.error_body("internal error; see the server log", "server_error")
        return _error_reply(request, 500, body)


@web.middleware
async def _tenants(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map the API key (a bearer token, or Anthropic's `x-api-key`) to its tenant; with no keys configured everyone
    is the anonymous tenant."""
    keys = request.app[SETTINGS].api_keys
    request[TENANT] = ""
    if keys and request.path.startswith("/v1/"):
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            key = request.headers.get("x-api-key", "")
        tenant = keys.get(key)
        if tenant is None:
            message = "a valid API key is required: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            return _error_reply(request, 401, api.error_body(message, "invalid_request_error", code="invalid_api_key"))
        request[TENANT] = tenant
    return await handler(request)


def _error_reply(
    request: web.Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    """Return an error in the shape of the request's API: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if request.path.startswith("/v1/messages"):
        body = anthropic.error_body(status, str(body.get("error", {}).get("message", "")))
    return web.json_response(body, status=status, headers=headers)


def _error_response(error: PrefixgateError) -> tuple[int, dict[str, Any]]:
    """Return the status and OpenAI error body of a domain error: the client's fault is 4xx, the server's 5xx."""
    if isinstance(error, ModelNotServed):
        return 404, api.error_body(str(error), "invalid_request_error", param="model", code="model_not_found")
    if isinstance(error, ModelStoppedError):
        return 503, api.error_body(str(error), "server_error")
    if isinstance(error, UpstreamError):
        # An upstream's own error (a 4xx the client can fix) as it wrote it; one that did not answer as a 502/503/504.
        if error.body is not None and error.status < 500:
            return error.status, error.body
        return (error.status if error.status >= 500 else 502), api.error_body(str(error), "server_error")
    if isinstance(error, RequestError | UnsupportedModelError):  # what was asked cannot be served as asked
        param = getattr(error, "param", None)
        code = "context_length_exceeded" if isinstance(error, ContextLengthError) else None
        return 400, api.error_body(str(error), "invalid_request_error", param=param, code=code)
    # A store or model failure: nothing the client can change, so its details go to the log, not the answer.
    return 500, api.error_body("internal error; see the server log", "server_error")


def _describe_problem(problem: Any) -> str:
    where = ".".join(str(part) for part in problem["loc"]) or "body"
    if problem["type"] == "extra_forbidden":
        return f"{where}: unknown field; remove it (prefixgate refuses fields it would otherwise ignore)"
    if problem["type"] == "missing":
        return f"{where}: required"
    return f"{where}: {problem['msg']}"
