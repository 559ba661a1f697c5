"""Upstreams: OpenAI-compatible servers (vLLM, SGLang, llama.cpp's server, another prefixgate) that generate for us.

`UpstreamPool` sends each request to the upstream the router chooses (`backends/router.py`), always streamed, with
`stream_options.include_usage` so the upstream's own token counts, `cached_tokens` among them, come back. It opens a
stream up to its first chunk before handing it over, so a failure before any token (refused connection, timeout, a 5xx)
is retried once on another upstream and the failed one leaves rotation for its backoff. An upstream's 4xx is the
client's to fix: it is passed on as the upstream wrote it, and nothing is retried. A failure after the first chunk
ends the stream with `UpstreamError`: its tokens may already be with the client, so it cannot be retried.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import aiohttp

from prefixgate.backends.backend import FinishReason, TokenChunk, TokenLogprob, ToolCallDelta, TopLogprob
from prefixgate.backends.router import DEFAULT_BALANCE_ABS, PrefixRouter, Route, Upstream
from prefixgate.errors import PrefixgateError

DEFAULT_CONNECT_TIMEOUT = 5.0  # seconds to open a connection to an upstream
DEFAULT_FIRST_CHUNK_TIMEOUT = 600.0  # seconds to its first chunk: a long prompt's prefill on a busy replica
DEFAULT_CHUNK_TIMEOUT = 60.0  # seconds between chunks once it streams
_MAX_ERROR_BYTES = 64 << 10  # of an upstream's error body kept to pass on


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    """Where one upstream is: its base URL as an OpenAI client takes it (`http://host:8000/v1`), and its key."""

    url: str
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class UpstreamUsage:
    """The token counts an upstream reports for one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens its own prefix cache served


class UpstreamError(PrefixgateError):
    """An upstream failed a request: its status and error body when it answered, or why it did not."""

    def __init__(self, message: str, *, status: int = 502, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body  # the upstream's own error JSON, passed on as it is

    @property
    def retryable(self) -> bool:
        """Return whether another upstream might succeed: it did not answer, or failed on its side."""
        return self.status >= 500


class UpstreamStream:
    """One request's answer from an upstream, chunk by chunk; its usage once the upstream has reported it."""

    def __init__(self, pool: UpstreamPool, route: Route, response: aiohttp.ClientResponse, chat: bool) -> None:
        self.pool = pool
        self.route = route
        self.usage: UpstreamUsage | None = None
        self.system_fingerprint: str | None = None
        self._response = response
        self._lines = _sse_data(response)
        self._chat = chat
        self._pending: list[TokenChunk] = []
        self._done = False  # the upstream said all it will
        self._ok = True  # nothing failed: the upstream stays in rotation
        self._closed = False

    @property
    def upstream(self) -> Upstream:
        """Return the upstream answering."""
        return self.route.upstream

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> TokenChunk:
        while not self._pending:
            if self._done:
                raise StopAsyncIteration
            await self._read()
        return self._pending.pop(0)

    async def first(self) -> None:
        """Read up to the first chunk, so a failure before it can be retried elsewhere."""
        while not self._pending and not self._done:
            await self._read()

    async def finish(self) -> None:
        """Read to the end of the answer: the usage comes after the last chunk."""
        while not self._done:
            await self._read()

    async def aclose(self, *, failed: bool = False) -> None:
        """Close the connection (an upstream stops generating when its client leaves) and count the request done;
        `failed` takes the upstream out of rotation for its backoff."""
        if self._closed:
            return
        self._closed = True
        self._response.close()
        self.pool.router.finished(self.upstream, ok=self._ok and not failed)

    async def _read(self) -> None:
        try:
            data = await anext(self._lines)
        except StopAsyncIteration:
            # Every OpenAI-compatible server ends a stream with [DONE]: without it, the upstream went away.
            self._ok = False
            raise UpstreamError(f"upstream {self.upstream.url} closed its answer before the end") from None
        except (aiohttp.ClientError, TimeoutError) as error:
            self._ok = False
            raise UpstreamError(f"upstream {self.upstream.url} broke off its answer: {_why(error)}") from error
        if data == "[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(data)
        except ValueError as error:
            self._ok = False
            message = f"upstream {self.upstream.url} sent an event that is not JSON: {data[:200]!r}"
            raise UpstreamError(message) from error
        if "error" in chunk:  # vLLM and prefixgate report a failure mid-stream as an error object
            self._ok = False
            message = chunk["error"].get("message", "") if isinstance(chunk["error"], dict) else str(chunk["error"])
            raise UpstreamError(f"upstream {self.upstream.url} failed while streaming: {message}", body=chunk)
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        if isinstance(chunk.get("system_fingerprint"), str):
            self.system_fingerprint = chunk["system_fingerprint"]
        for choice in chunk.get("choices") or ():
            try:
                piece = _piece(choice, self._chat)
            except (KeyError, TypeError, ValueError) as error:
                self._ok = False
                message = f"upstream {self.upstream.url} sent a chunk this server cannot read: {data[:200]!r}"
                raise UpstreamError(message) from error
            if piece != _NOTHING:
                self._pending.append(piece)


class UpstreamPool:
    """The upstreams, their HTTP connections and the router that chooses among them. Use on one event loop."""

    def __init__(
        self,
        upstreams: Sequence[UpstreamConfig],
        *,
        balance: int = DEFAULT_BALANCE_ABS,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        first_chunk_timeout: float = DEFAULT_FIRST_CHUNK_TIMEOUT,
        chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configs = {config.url.rstrip("/"): config for config in upstreams}
        self.router = PrefixRouter(list(self.configs), balance_abs=balance, clock=clock)
        self._timeout = aiohttp.ClientTimeout(
            sock_connect=connect_timeout, sock_read=chunk_timeout, total=None, connect=connect_timeout
        )
        self._first_chunk_timeout = first_chunk_timeout
        self._check_timeout = aiohttp.ClientTimeout(total=connect_timeout)
        self._session: aiohttp.ClientSession | None = None
        self._check_session: aiohttp.ClientSession | None = None

    async def open(
        self, endpoint: str, body: dict[str, Any], keys: Sequence[bytes], hint: str | None = None
    ) -> UpstreamStream:
        """Send a request (`endpoint` "chat/completions" or "completions") and return its stream at its first chunk.

        A failure before the first chunk is retried once on another upstream. Raise UpstreamError when the request
        failed (with the upstream's status and body when it answered), and LookupError when no upstream may take it.
        """
        tried: list[Upstream] = []
        while True:
            route = self.router.choose(keys, hint, exclude=tried)
            # Recorded now, not at the first chunk: requests with this prefix that arrive while it computes it go
            # there too (unless it is busy), as they would once it holds it. A failure makes the router forget it.
            self.router.sent(route.upstream, keys)
            try:
                stream = await self._open(route, endpoint, body)
            except UpstreamError as error:
                tried.append(route.upstream)
                if not error.retryable or len(tried) > 1 or len(tried) == len(self.router.upstreams):
                    raise
                continue
            return stream

    async def models(self, upstream: Upstream) -> list[str]:
        """Return the model ids an upstream serves (`GET /models`, within the connect timeout); raise UpstreamError
        when it does not answer, or not with a list of models.

        Each call opens a connection of its own: a kept-alive one may have outlived the upstream's process, and a
        health check must not fail on it, or pass on it.
        """
        if self._check_session is None:
            connector = aiohttp.TCPConnector(force_close=True)
            self._check_session = aiohttp.ClientSession(timeout=self._check_timeout, connector=connector)
        try:
            async with self._check_session.get(f"{upstream.url}/models", headers=self._headers(upstream)) as response:
                if response.status != 200:
                    hint = "" if upstream.url.endswith("/v1") else f" (is its API under {upstream.url}/v1?)"
                    raise UpstreamError(f"upstream {upstream.url} answered /models with {response.status}{hint}")
                listing = await response.json()
            return [str(entry["id"]) for entry in listing["data"]]
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            raise UpstreamError(f"upstream {upstream.url} did not answer /models: {_why(error)}") from error
        except (KeyError, TypeError) as error:
            raise UpstreamError(f"upstream {upstream.url} answered /models without a list of models") from error

    async def close(self) -> None:
        """Close every connection."""
        for session in (self._session, self._check_session):
            if session is not None:
                await session.close()

    async def _open(self, route: Route, endpoint: str, body: dict[str, Any]) -> UpstreamStream:
        upstream = route.upstream
        payload = body | {"stream": True, "stream_options": {"include_usage": True}}
        self.router.started(upstream)
        try:
            response = await self._client().post(
                f"{upstream.url}/{endpoint}", json=payload, headers=self._headers(upstream)
            )
        except (aiohttp.ClientError, TimeoutError) as error:
            self.router.finished(upstream, ok=False)
            raise UpstreamError(f"upstream {upstream.url} did not answer: {_why(error)}") from error
        if response.status != 200:
            refused = await _error(upstream, response)
            self.router.finished(upstream, ok=not refused.retryable)
            raise refused
        stream = UpstreamStream(self, route, response, chat=endpoint == "chat/completions")
        try:
            async with asyncio.timeout(self._first_chunk_timeout):
                await stream.first()
        except TimeoutError:
            await stream.aclose(failed=True)
            raise UpstreamError(
                f"upstream {upstream.url} sent nothing for {self._first_chunk_timeout:g} s", status=504
            ) from None
        except UpstreamError:
            await stream.aclose()
            raise
        return stream

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    def _headers(self, upstream: Upstream) -> dict[str, str]:
        key = self.configs[upstream.url].api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield the data of each server-sent event (an error event's data is an error object)."""
    async for raw in response.content:
        line = raw.decode("utf-8", errors="replace").strip()
        if line.startswith("data:"):
            yield line[len("data:") :].strip()


async def _error(upstream: Upstream, response: aiohttp.ClientResponse) -> UpstreamError:
    raw = await response.content.read(_MAX_ERROR_BYTES)
    response.close()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        text = raw.decode("utf-8", errors="replace")[:500]
        return UpstreamError(f"upstream {upstream.url} answered {response.status}: {text}", status=response.status)
    message = body["error"].get("message", "")
    return UpstreamError(f"upstream {upstream.url}: {message}", status=response.status, body=body)


def _why(error: Exception) -> str:
    return str(error) or type(error).__name__  # a timeout says nothing of itself


_NOTHING = TokenChunk(-1, "", None)


def _piece(choice: dict[str, Any], chat: bool) -> TokenChunk:
    """Return what one choice of a streamed chunk carries (the chat API's delta, or the completions API's text), as
    the engine's chunk: no token id (an upstream sends text), and the stop string it names, when it names one
    (vLLM's `stop_reason`, SGLang's `matched_stop`)."""
    delta = (choice.get("delta") or {}) if chat else {"content": choice.get("text")}
    stop = choice.get("stop_reason", choice.get("matched_stop"))  # a stop token's id when not a string
    # vLLM names reasoning `reasoning_content` (and, from 0.10, `reasoning` too); SGLang `reasoning_content`.
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return TokenChunk(
        token_id=-1,
        text=delta.get("content") or "",
        # OpenAI's finish reasons, as the local backend's are; any other an upstream names goes on as it came.
        finish_reason=cast(FinishReason | None, choice.get("finish_reason")),
        stop_sequence=stop if isinstance(stop, str) else None,
        tool_calls=tuple(_tool_call(call) for call in delta.get("tool_calls") or ()),
        reasoning=str(reasoning),
        refusal=str(delta.get("refusal") or ""),
        logprobs=_logprobs(choice.get("logprobs"), chat),
    )


def _tool_call(call: dict[str, Any]) -> ToolCallDelta:
    function = call.get("function") or {}
    return ToolCallDelta(int(call["index"]), call.get("id"), function.get("name"), function.get("arguments") or "")


def _logprobs(logprobs: dict[str, Any] | None, chat: bool) -> tuple[TokenLogprob, ...]:
    """Return a chunk's log probabilities from the chat API's `content` list, or the completions API's columns."""
    if not logprobs:
        return ()
    if chat:
        return tuple(
            TokenLogprob(
                entry["token"],
                float(entry["logprob"]),
                _bytes(entry.get("bytes")),
                tuple(
                    TopLogprob(top["token"], float(top["logprob"]), _bytes(top.get("bytes")))
                    for top in entry.get("top_logprobs") or ()
                ),
            )
            for entry in logprobs.get("content") or ()
        )
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs["tokens"])
    return tuple(
        TokenLogprob(
            token,
            float(logprob),
            None,
            tuple(TopLogprob(name, float(value), None) for name, value in (top or {}).items()),
        )
        for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], tops, strict=True)
    )


def _bytes(value: list[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(byte) for byte in value)


def _usage(usage: dict[str, Any]) -> UpstreamUsage:
    details = usage.get("prompt_tokens_details") or {}
    return UpstreamUsage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )
