"""Where a `PromptCache` sends requests: an engine in this process, or a prefixgate server over HTTP.

Both take the engine's `PromptRequest` and give back the same `Reply` and stream of pieces, so the decorator above
them does not know which one it talks to.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, Protocol

import aiohttp

from prefixgate.errors import ContextLengthError, PrefixgateError, RequestError
from prefixgate.proxy.engine import Engine, PromptRequest, Usage
from prefixgate.proxy.openai import api
from prefixgate.proxy.python.reply import Pieces, Reply, ReplyUsage


class ServerError(PrefixgateError, ConnectionError):
    """A prefixgate server cannot be reached, failed on its side (5xx), or answered something that is not its API."""


class Target(Protocol):
    """Run requests for a PromptCache, on the PromptCache's event loop."""

    async def complete(self, request: PromptRequest) -> Reply:
        """Run a request to the end."""
        ...

    def stream(self, request: PromptRequest) -> Pieces:
        """Stream a request's text pieces, then its Reply; nothing starts before the first piece is asked for."""
        ...

    async def close(self) -> None:
        """Release what the target holds."""
        ...

    def flush(self) -> None:
        """Block until what the target computed is safe on disk; called at exit, so it must need no event loop."""
        ...


class EngineTarget:
    """Run requests on an engine in this process (the same pipeline the HTTP server runs)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def complete(self, request: PromptRequest) -> Reply:
        """Run a request to the end."""
        completion = await self.engine.complete(request)
        return Reply(completion.text, completion.finish_reason, _engine_usage(completion.usage))

    async def stream(self, request: PromptRequest) -> AsyncGenerator[str | Reply, None]:
        """Stream a request's text pieces, then its Reply."""
        generation = await self.engine.generate(request)
        text: list[str] = []
        async with generation:  # leaving early (aclose of this generator) stops the model within one step
            async for chunk in generation:
                if chunk.text:
                    text.append(chunk.text)
                    yield chunk.text
        yield Reply("".join(text), generation.finish_reason or "stop", _engine_usage(generation.usage()))

    async def close(self) -> None:
        """Stop the model and close the store."""
        await self.engine.close()

    def flush(self) -> None:
        """Block until every block filed so far is written to the disk tier."""
        self.engine.store.wait_for_writes()


class ServerTarget:
    """Run requests on a prefixgate server through its OpenAI-compatible API (aiohttp, so no new dependency)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self._session = session

    @classmethod
    async def connect(
        cls, url: str, *, api_key: str | None = None, model: str | None = None, timeout: float | None = 600.0
    ) -> ServerTarget:
        """Open a session to the server at `url`; with no `model`, use the one the server serves."""
        if not isinstance(url, str):
            raise TypeError(
                f"connect() takes the server's URL as a string, such as 'http://127.0.0.1:8000', not {url!r}"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout is in seconds and must be more than 0 (or None for none), not {timeout!r}")
        # An OpenAI-style base URL ends in /v1; accept both spellings, since users copy either.
        base = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout))
        target = cls(session, base, model or "")
        try:
            if model is None:
                listing = await target._get("/v1/models")
                try:
                    target.model = str(listing["data"][0]["id"])
                except (KeyError, IndexError, TypeError):
                    raise ServerError(f"{base}/v1/models lists no model; pass model=... to connect()") from None
        except BaseException:
            await session.close()
            raise
        return target

    async def complete(self, request: PromptRequest) -> Reply:
        """Run a request to the end."""
        chat = request.messages is not None
        body = await self._post(request, stream=False)
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return Reply(text or "", choice["finish_reason"] or "stop", _server_usage(body["usage"]))
        except (KeyError, IndexError, TypeError) as error:
            raise ServerError(f"{self.url} answered a completion without {error}; is it a prefixgate server?") from None

    async def stream(self, request: PromptRequest) -> AsyncGenerator[str | Reply, None]:
        """Stream a request's text pieces over server-sent events, then its Reply."""
        chat = request.messages is not None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        text: list[str] = []
        finish_reason = "stop"
        usage: ReplyUsage | None = None
        async with self._request("POST", path, json=self._body(request, stream=True)) as response:
            await self._check(response)
            async for event, data in _events(response):
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if event == "error":
                    raise _error(200, payload, self.url)
                if payload.get("usage"):
                    usage = _server_usage(payload["usage"])
                for choice in payload.get("choices", ()):
                    piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                    if piece:
                        text.append(piece)
                        yield piece
                    finish_reason = choice.get("finish_reason") or finish_reason
        if usage is None:
            raise ServerError(f"{self.url} ended a stream without usage; is it a prefixgate server?")
        yield Reply("".join(text), finish_reason, usage)

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._session.close()

    def flush(self) -> None:
        """Do nothing: the server keeps its own cache."""

    # -- HTTP -----------------------------------------------------------------------------------------------------

    def _body(self, request: PromptRequest, *, stream: bool) -> dict[str, Any]:
        chat = request.messages is not None
        body = api.sampling_fields(self.model, request.params, chat=chat) | {"layout": request.layout}
        if request.messages is not None:
            body["messages"] = request.messages
        else:
            body["prompt"] = request.prompt
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def _post(self, request: PromptRequest, *, stream: bool) -> dict[str, Any]:
        path = "/v1/chat/completions" if request.messages is not None else "/v1/completions"
        async with self._request("POST", path, json=self._body(request, stream=stream)) as response:
            await self._check(response)
            return await self._json(response)

    async def _get(self, path: str) -> dict[str, Any]:
        async with self._request("GET", path) as response:
            await self._check(response)
            return await self._json(response)

    def _request(self, method: str, path: str, **kwargs: Any) -> _Response:
        return _Response(self._session, method, self.url + path, kwargs)

    async def _check(self, response: aiohttp.ClientResponse) -> None:
        if response.status < 400:
            return
        try:
            body = await response.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            body = None
        if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):  # a web page, or nothing
            message = (
                f"HTTP {response.status} {response.reason} with no OpenAI error; is {self.url} a prefixgate server?"
            )
            body = {"error": {"message": message}}
        raise _error(response.status, body, self.url)

    async def _json(self, response: aiohttp.ClientResponse) -> dict[str, Any]:
        try:
            body = await response.json(content_type=None)
        except ValueError:
            raise ServerError(f"{self.url} answered with something that is not JSON") from None
        if not isinstance(body, dict):
            raise ServerError(f"{self.url} answered with JSON that is not an object")
        return body


class _Response:
    """One HTTP exchange as an async context manager, turning transport failures into ServerError."""

    def __init__(self, session: aiohttp.ClientSession, method: str, url: str, kwargs: dict[str, Any]) -> None:
        self._session = session
        self._method = method
        self._url = url
        self._kwargs = kwargs
        self._response: aiohttp.ClientResponse | None = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        try:
            self._response = await self._session.request(self._method, self._url, **self._kwargs)
        except aiohttp.ClientError as error:
            raise ServerError(f"cannot reach the prefixgate server at {self._url}: {error}") from error
        return self._response

    async def __aexit__(self, *exc_info: object) -> None:
        if self._response is not None:
            self._response.release()


async def _events(response: aiohttp.ClientResponse) -> AsyncGenerator[tuple[str | None, str], None]:
    """Split a server-sent event stream into (event, data) pairs."""
    event: str | None = None
    try:
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if not line:
                event = None  # a blank line ends an event
            elif line.startswith("event:"):
                event = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                yield event, line.removeprefix("data:").strip()
    except aiohttp.ClientError as error:
        raise ServerError(f"the server's stream broke off: {error}") from error


def _error(status: int, body: dict[str, Any], url: str) -> PrefixgateError:
    """Turn an OpenAI error body into prefixgate's exception: the server's message, and the field to change."""
    raw = body.get("error")
    error: dict[str, Any] = raw if isinstance(raw, dict) else {}
    message = str(error.get("message") or f"HTTP {status}")
    if status >= 500 or error.get("type") == "server_error":
        return ServerError(f"the prefixgate server at {url} failed: {message}")
    if error.get("code") == "context_length_exceeded":
        return ContextLengthError(message, param=error.get("param"))
    return RequestError(message, param=error.get("param"))


def _engine_usage(usage: Usage) -> ReplyUsage:
    return ReplyUsage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)


def _server_usage(usage: dict[str, Any]) -> ReplyUsage:
    details = usage.get("prompt_tokens_details") or {}
    return ReplyUsage(usage["prompt_tokens"], usage["completion_tokens"], details.get("cached_tokens") or 0)
