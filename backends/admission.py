"""Admission: running requests draw on a KV memory budget and a count; the rest wait in a bounded queue, in order.

A request is admitted before any of its KV memory is allocated, and holds its share (its prompt plus every token it
may generate) until the model thread lets it go, so the KV memory of running requests never exceeds the budget and
no request needs to be stopped halfway for room. A request that finds the queue full is refused at once
(`OverloadedError`, HTTP 429): a client can retry elsewhere or later, where waiting behind a long queue would only
hold its connection.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass

from prefixgate.errors import OverloadedError, RequestError

RETRY_AFTER_SECONDS = 1  # what a refused request is told; a queue slot frees up within a few model steps


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    """How many requests run and wait, and the KV memory the running ones hold."""

    running: int
    waiting: int
    bytes_in_use: int
    budget_bytes: int
    max_running: int
    max_waiting: int
    # Prefixes running requests read in place where the store's top tier holds them, and their bytes: the tier's
    # memory, not in bytes_in_use.
    shared_prefixes: int = 0
    shared_bytes: int = 0


@dataclass(slots=True)
class _Waiter:
    nbytes: int
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    admitted: bool = False


class Admission:
    """Admit requests first come, first served, while the KV budget and the running count allow. Thread-safe."""

    def __init__(self, *, budget_bytes: int, max_running: int, max_waiting: int) -> None:
        if budget_bytes < 1 or max_running < 1 or max_waiting < 0:
            raise RuntimeError("admission needs a positive budget and running count, and a queue length of 0 or more")
        self.budget_bytes = budget_bytes
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._lock = threading.Lock()
        self._running = 0
        self._in_use = 0
        self._waiting: collections.deque[_Waiter] = collections.deque()

    async def enter(self, nbytes: int) -> None:
        """Return once `nbytes` of KV memory are the caller's; give them back with `leave(nbytes)`.

        Raises RequestError when the request could never fit, OverloadedError when the queue is full.
        """
        if nbytes > self.budget_bytes:
            raise RequestError(
                f"this request needs {nbytes} bytes of KV memory for its prompt and max_tokens, more than the "
                f"server's whole budget of {self.budget_bytes} (kv_memory_budget); lower max_tokens or shorten "
                "the prompt",
                param="max_tokens",
            )
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiting and self._fits(nbytes):
                self._take(nbytes)
                return
            if len(self._waiting) >= self.max_waiting:
                raise OverloadedError(
                    f"the server is at capacity: {self._running} requests running and {len(self._waiting)} "
                    f"waiting; retry in {RETRY_AFTER_SECONDS} s",
                    retry_after=RETRY_AFTER_SECONDS,
                )
            waiter = _Waiter(nbytes, loop.create_future(), loop)
            self._waiting.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                if waiter.admitted:  # admitted as the caller left: nobody will use the share
                    self._give_back(nbytes)
                else:
                    self._waiting.remove(waiter)
                    self._admit_waiters()  # the head may have been what held the others back
            raise

    def leave(self, nbytes: int) -> None:
        """Give back a share taken by `enter`, from any thread, and admit whoever waits and now fits."""
        with self._lock:
            self._give_back(nbytes)

    def adjust(self, delta: int) -> None:
        """Count `delta` more bytes (negative: fewer) whatever the budget, from any thread: a request whose shared
        prefix failed to fill holds its whole prompt after all."""
        with self._lock:
            self._add(delta)

    def stats(self) -> AdmissionStats:
        """Return the counts and bytes as they are now."""
        with self._lock:
            return AdmissionStats(
                self._running,
                len(self._waiting),
                self._in_use,
                self.budget_bytes,
                self.max_running,
                self.max_waiting,
            )

    def _fits(self, nbytes: int) -> bool:
        return self._running < self.max_running and self._in_use + nbytes <= self.budget_bytes

    def _take(self, nbytes: int) -> None:
        self._running += 1
        self._in_use += nbytes

    def _add(self, delta: int) -> None:
        self._in_use += delta
        assert self._in_use >= 0, "more bytes were given back than taken"
        if delta < 0:
            self._admit_waiters()

    def _give_back(self, nbytes: int) -> None:
        assert self._running > 0 and self._in_use >= nbytes, "a share was given back twice"
        self._running -= 1
        self._in_use -= nbytes
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        # First come, first served: a large request at the head is not overtaken, so it cannot starve.
        while self._waiting and self._fits(self._waiting[0].nbytes):
            waiter = self._waiting.popleft()
            self._take(waiter.nbytes)
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.future)
            except RuntimeError:  # its event loop is closed: nobody is left to run the request
                self._running -= 1
                self._in_use -= waiter.nbytes
                continue
            waiter.admitted = True


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # a waiter cancelled meanwhile gives its share back itself
        future.set_result(None)
