"""What the HTTP faces' handlers share: the app's keys, the engine a request names, its generations started, the
headers of their answers, server-sent events and the relay of a stream's chunks, and domain errors as OpenAI's."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from prefixgate.backends import TokenChunk
from prefixgate.backends.router import Upstream
from prefixgate.backends.upstream import UpstreamError
from prefixgate.errors import (
    ContextLengthError,
    ModelStoppedError,
    PrefixgateError,
    RequestError,
    UnsupportedModelError,
)
from prefixgate.proxy.body import OFF_LOOP_BYTES, let_go, off_loop
from prefixgate.proxy.choices import AnyEngine, AnyGeneration, Choices
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.layout import describe
from prefixgate.proxy.openai.api import error_body
from prefixgate.proxy.settings import Settings
from prefixgate.proxy.upstream_engine import UpstreamEngine

log = logging.getLogger(__name__)

ENGINE: web.AppKey[AnyEngine] = web.AppKey("engine")
METRICS = web.AppKey("metrics", CollectorRegistry)
SETTINGS = web.AppKey("settings", Settings)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
CHOICES: web.RequestKey[Choices] = web.RequestKey("choices")  # the request's generations, for its log line
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Body(Protocol):
    """A face's request body: what the engine is asked, for a tenant."""

    def to_prompt_request(self, tenant: str) -> PromptRequest: ...


class ModelNotServed(PrefixgateError, LookupError):
    """A request names a model this server does not serve."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"the model {asked!r} does not exist here; this server serves {served!r}")


def engine_for(request: web.Request, model: str) -> AnyEngine:
    """Return the engine serving `model`; raise ModelNotServed for another name."""
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


async def prompt_request(request: web.Request, body: Body) -> PromptRequest:
    """Return the engine's request for a body: off the loop for a large one, as the body was parsed (400,000
    messages take a third of a second to translate)."""
    if (request.content_length or 0) <= OFF_LOOP_BYTES:
        return body.to_prompt_request(request[TENANT])
    return await off_loop(_translated, body, request[TENANT])


async def start(request: web.Request, model: str, prompt: PromptRequest, *, prompt_param: str, n: int = 1) -> Choices:
    """Start the request's `n` generations on the engine serving `model`, each up to its first token; an error about
    the engine's prompt names the field the body sent it in, `prompt_param`."""
    try:
        choices = await Choices.start(engine_for(request, model), prompt, n)
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


def answer_headers(generation: AnyGeneration) -> dict[str, str]:
    """Return the headers of a generation's answer: the engine's times, its cached tokens, the layout's moves."""
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


# -- streams ------------------------------------------------------------------------------------------------------


async def open_stream(request: web.Request, generation: AnyGeneration) -> web.StreamResponse:
    """Begin a stream of server-sent events answering with `generation` (its headers sent)."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **answer_headers(generation)}
    response = web.StreamResponse(headers=headers)
    await response.prepare(request)
    return response


async def send_event(response: web.StreamResponse, name: str, body: dict[str, Any]) -> None:
    """Send a named event (Anthropic's and the Responses API's streams)."""
    await response.write(f"event: {name}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode())


async def send_data(response: web.StreamResponse, body: dict[str, Any], *, off_loop: bool = False) -> None:
    """Send an unnamed event (the chat and text completions streams); a large one written out `off_loop`."""
    dumps = functools.partial(json.dumps, body, ensure_ascii=False)
    text = await asyncio.to_thread(dumps) if off_loop else dumps()
    await response.write(f"data: {text}\n\n".encode())


async def relay(
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
        status, body = streaming_failure(rid, error)
        await fail(status, body["error"]["message"])
        await response.write_eof()
        return False
    return True


def streaming_failure(request_id: str, error: Exception) -> tuple[int, dict[str, Any]]:
    """Return the status and OpenAI error body of an error raised after a stream began; log what is the server's."""
    if isinstance(error, PrefixgateError):
        status, body = error_response(error)
        if status >= 500:
            log.error("request %s failed while streaming: %s: %s", request_id, type(error).__name__, error)
        return status, body
    log.exception("request %s failed while streaming", request_id)  # called in the handler's except: it has the trace
    return 500, error_body("internal error while generating; see the server log", "server_error")


def error_response(error: PrefixgateError) -> tuple[int, dict[str, Any]]:
    """Return the status and OpenAI error body of a domain error: the client's fault is 4xx, the server's 5xx."""
    if isinstance(error, ModelNotServed):
        return 404, error_body(str(error), "invalid_request_error", param="model", code="model_not_found")
    if isinstance(error, ModelStoppedError):
        return 503, error_body(str(error), "server_error")
    if isinstance(error, UpstreamError):
        # An upstream's own error (a 4xx the client can fix) as it wrote it; one that did not answer as a 502/503/504.
        if error.body is not None and error.status < 500:
            return error.status, error.body
        return (error.status if error.status >= 500 else 502), error_body(str(error), "server_error")
    if isinstance(error, RequestError | UnsupportedModelError):  # what was asked cannot be served as asked
        param = getattr(error, "param", None)
        code = "context_length_exceeded" if isinstance(error, ContextLengthError) else None
        return 400, error_body(str(error), "invalid_request_error", param=param, code=code)
    # A store or model failure: nothing the client can change, so its details go to the log, not the answer.
    return 500, error_body("internal error; see the server log", "server_error")


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
