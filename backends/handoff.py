"""The hand-off: carry a job's results from the model thread to the coroutine awaiting them on its event loop."""

from __future__ import annotations

import asyncio
from typing import TypeAlias

from prefixgate.backends.backend import TokenChunk

HandoffItem: TypeAlias = TokenChunk | int | BaseException


class LoopHandoff:
    """Pass a job's tokens, prefill count or error to one event loop, thread-safely; implements JobConsumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[HandoffItem] = asyncio.Queue()
        self._open = True

    async def get(self) -> HandoffItem:
        """Wait for the next item (call on the loop given at construction)."""
        return await self._queue.get()

    def close(self) -> None:
        """Tell the job that nobody reads any more; its next delivery returns False."""
        self._open = False

    def token(self, chunk: TokenChunk) -> bool:
        """Deliver one generated token from the worker thread."""
        return self._post(chunk)

    def prefilled(self, tokens: int) -> bool:
        """Deliver the token count of a finished prefill-only job from the worker thread."""
        return self._post(tokens)

    def error(self, error: BaseException) -> None:
        """Deliver the error that ended the job from the worker thread."""
        self._post(error)

    def _post(self, item: HandoffItem) -> bool:
        if not self._open:
            return False
        try:
            # The queue belongs to the loop: only the loop's own thread may touch it, hence call_soon_threadsafe.
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed, so nobody will ever read this
            self._open = False
        return self._open
