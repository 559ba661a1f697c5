"""The app's middlewares, outermost first: a request id, one log line per request, errors in the shape of the request's
API, and tenants from API keys; and the signal that puts the request id on every response."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError

from prefixgate.errors import OverloadedError, PrefixgateError
from prefixgate.proxy.anthropic import api as anthropic
from prefixgate.proxy.openai.api import error_body
from prefixgate.proxy.serving import CHOICES, REQUEST_ID, SETTINGS, TENANT, Handler, error_response

log = logging.getLogger(__name__)
request_log = logging.getLogger("prefixgate.requests")  # one line per request; its fields ride on the record


@web.middleware
async def request_ids(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Take the client's `x-request-id`, or make one."""
    request[REQUEST_ID] = request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
    return await handler(request)


@web.middleware
async def log_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
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


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every failure in the shape of the request's API: the client's with a 4xx that says what to change."""
    try:
        return await handler(request)
    except OverloadedError as error:
        body = error_body(str(error), "rate_limit_error", code="server_overloaded")
        return _error_reply(request, 429, body, headers={"Retry-After": str(error.retry_after)})
    except PrefixgateError as error:
        status, body = error_response(error)
        if status >= 500:
            log.error("request %s failed: %s: %s", request.get(REQUEST_ID), type(error).__name__, error)
        return _error_reply(request, status, body)
    except ValidationError as error:
        problems = error.errors()
        param = ".".join(str(part) for part in problems[0]["loc"]) if problems else None
        message = "; ".join(_describe_problem(problem) for problem in problems)
        return _error_reply(request, 400, error_body(message, "invalid_request_error", param=param))
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        message = f"the request body is larger than {limit} bytes; send a smaller one (max_body_bytes)"
        return _error_reply(request, 413, error_body(message, "invalid_request_error"))
    except RequestPayloadError as error:  # a body that does not decode as its Content-Encoding says, or cut short
        # Nothing more is read from this connection, which then closes: aiohttp would otherwise read on, meet the
        # error again and log it, and what follows in the stream is no request.
        request.content.feed_eof()
        reason = str(error).strip().splitlines()[-1].strip()
        message = f"the request body could not be read ({reason}); send it as its Content-Encoding header says"
        reply = _error_reply(request, 400, error_body(message, "invalid_request_error"))
        reply.force_close()
        return reply
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = f"{request.method} {request.path}: {error.reason}"
        code = "not_found" if error.status == 404 else None
        return _error_reply(request, error.status, error_body(message, "invalid_request_error", code=code))
    except ConnectionResetError:
        raise  # the client left: nobody to answer, and no fault of the server's
    except Exception:
        log.exception("request %s failed", request.get(REQUEST_ID))
        return _error_reply(request, 500, error_body("internal error; see the server log", "server_error"))


@web.middleware
async def tenants(request: web.Request, handler: Handler) -> web.StreamResponse:
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
            return _error_reply(request, 401, error_body(message, "invalid_request_error", code="invalid_api_key"))
        request[TENANT] = tenant
    return await handler(request)


MIDDLEWARES = [request_ids, log_requests, errors, tenants]


async def send_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Put the request's id on its response as its headers go out."""
    # A signal, not the middleware: a streamed response is prepared by its handler, before any middleware sees it.
    request_id = request.get(REQUEST_ID)
    if request_id is not None:
        response.headers["x-request-id"] = request_id


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


def _error_reply(
    request: web.Request, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    """Return an error in the shape of the request's API: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    if request.path.startswith("/v1/messages"):
        body = anthropic.error_body(status, str(body.get("error", {}).get("message", "")))
    return web.json_response(body, status=status, headers=headers)


def _describe_problem(problem: Any) -> str:
    where = ".".join(str(part) for part in problem["loc"]) or "body"
    if problem["type"] == "extra_forbidden":
        return f"{where}: unknown field; remove it (prefixgate refuses fields it would otherwise ignore)"
    if problem["type"] == "missing":
        return f"{where}: required"
    return f"{where}: {problem['msg']}"
