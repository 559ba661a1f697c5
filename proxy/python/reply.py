"""What a decorated function gives back: a whole `Reply`, or a stream of text pieces that ends in one.

Both targets of a `PromptCache` (an in-process engine and a prefixgate server) produce the same types, so an
application moves between them without changing how it reads results.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

_T = TypeVar("_T")

Pieces = AsyncIterator["str | Reply"]
"""What a target streams: text pieces as they are generated, then exactly one `Reply` (the whole result)."""


@dataclass(frozen=True, slots=True)
class ReplyUsage:
    """Token counts of one reply; `cached_tokens` of the prompt were served from the cache, not computed."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        """Return prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Reply:
    """The whole result of one call: the generated text, why generation stopped, and token usage."""

    text: str
    finish_reason: str  # "stop" (end of turn or a stop string) or "length" (max_tokens reached)
    usage: ReplyUsage

    def __str__(self) -> str:
        return self.text


class _Streamed:
    """What both stream kinds share: the whole reply, known once the text has all arrived."""

    _reply: Reply | None

    @property
    def reply(self) -> Reply:
        """Return the whole result; only once the stream is exhausted."""
        if self._reply is None:
            raise RuntimeError("the reply is known once the stream is exhausted; iterate it to the end first")
        return self._reply


class ReplyStream(_Streamed):
    """Iterate the text of one reply as it is generated; `reply` holds the whole result once iteration ends.

    The request starts with the first `next()`; leave early with `close()` or a `with` block, which stops the model.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, pieces: Pieces) -> None:
        self._loop = loop
        self._pieces = pieces
        self._reply: Reply | None = None
        self._closed = False

    def __iter__(self) -> ReplyStream:
        return self

    def __next__(self) -> str:
        if self._closed:
            raise StopIteration
        try:
            piece = self._run(_next_piece(self._pieces))
        except BaseException:
            self.close()
            raise
        if isinstance(piece, Reply):
            self._reply = piece
            self.close()
            raise StopIteration
        return piece

    def close(self) -> None:
        """Stop generating; text already received stays received."""
        if self._closed:
            return
        self._closed = True
        if not self._loop.is_closed():
            self._run(_close_pieces(self._pieces))

    def __enter__(self) -> ReplyStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        # The pieces live on the PromptCache's loop thread: their model stream is bound to that loop.
        return asyncio.run_coroutine_threadsafe(coroutine, _open(self._loop, coroutine)).result()


class AsyncReplyStream(_Streamed):
    """Iterate, with `async for`, the text of one reply as it is generated; `reply` holds the whole result at the end.

    The request starts with the first `anext()`; leave early with `aclose()` or `async with`, which stops the model.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, open_pieces: Callable[[], Awaitable[Pieces]]) -> None:
        self._loop = loop
        self._open_pieces = open_pieces
        self._pieces: Pieces | None = None
        self._reply: Reply | None = None
        self._closed = False

    def __aiter__(self) -> AsyncReplyStream:
        return self

    async def __anext__(self) -> str:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._pieces is None:
                # The decorated function runs here, in the caller's loop; the model runs on the cache's loop.
                self._pieces = await self._open_pieces()
            piece = await self._run(_next_piece(self._pieces))
        except BaseException:
            await self.aclose()
            raise
        if isinstance(piece, Reply):
            self._reply = piece
            await self.aclose()
            raise StopAsyncIteration
        return piece

    async def aclose(self) -> None:
        """Stop generating; text already received stays received."""
        if self._closed:
            return
        self._closed = True
        if self._pieces is not None and not self._loop.is_closed():
            await self._run(_close_pieces(self._pieces))

    async def __aenter__(self) -> AsyncReplyStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, _open(self._loop, coroutine)))


def _open(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[Any, Any, Any]) -> asyncio.AbstractEventLoop:
    if loop.is_closed():
        coroutine.close()  # never scheduled: close it so Python does not warn that it was never awaited
        raise RuntimeError("this stream's PromptCache is closed; iterate streams before closing the cache")
    return loop


async def _next_piece(pieces: Pieces) -> str | Reply:
    try:
        return await anext(pieces)
    except StopAsyncIteration:
        raise RuntimeError("a prefixgate target ended its stream without a reply") from None


async def _close_pieces(pieces: Pieces) -> None:
    aclose = getattr(pieces, "aclose", None)
    if aclose is not None:
        await aclose()
