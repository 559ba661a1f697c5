"""KV buffers: the memory each running request's cache lives in, reserved at admission and reused afterwards.

A buffer is one tensor `[layers, 2, kv_heads, capacity, head_dim]`. A request reserves its share of the KV budget
(its prompt plus every token it may generate), borrows a buffer, the store fetches the cached prefix into its leading
positions, and the model thread runs the request's cache in that same memory: the prefix is copied once, from the
store straight to where attention reads it. When the request ends the buffer comes back for the next one. On a CPU
that reuse matters: filling memory the process has not touched yet costs a page fault per 4 KiB, and a used buffer
fills about four times faster (SmolLM2 at 4k tokens, 180 MB: about 30 ms instead of 130 ms on a 2-core machine).
A request that starts from a shared prefix (`shared_prefix.py`) reserves and borrows for what follows it only: the
prefix lies in the store's top tier.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from prefixgate.backends.backend import KVGeometry

if TYPE_CHECKING:  # shared_prefix builds on this module's buffers
    from prefixgate.backends.shared_prefix import PrefixStart

# Capacities are multiples of this many tokens (a block of the default size), so kept buffers fit many prompt lengths,
# while a request's share stays close to what it holds: 32 requests after one shared prefix, each with a short
# question and 64 tokens to answer, would reserve 1.6 times their tokens at 256.
GRANULE = 64


def round_up(tokens: int) -> int:
    """Return the buffer capacity that holds `tokens` tokens."""
    return -(-max(tokens, 1) // GRANULE) * GRANULE


class KVBuffers:
    """Hand out KV buffers and keep up to `keep_bytes` of returned ones for reuse. Thread-safe."""

    def __init__(self, geometry: KVGeometry, device: torch.device, *, keep_bytes: int = 1 << 30) -> None:
        self.geometry = geometry
        self.device = device
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # returned buffers, oldest first
        self._lock = threading.Lock()

    def nbytes_for(self, tokens: int) -> int:
        """Return the bytes of a buffer that holds `tokens` tokens (every layer's K and V)."""
        return round_up(tokens) * (self.geometry.block_nbytes // self.geometry.block_size)

    def take(self, tokens: int, most: int) -> torch.Tensor:
        """Return a buffer for `tokens` to `most` tokens: the smallest kept one that fits, or a new one."""
        capacity = round_up(tokens)
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if capacity <= b.shape[3] <= most]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].shape[3]))
        g = self.geometry
        # An ordinary tensor even when taken on the model's thread (inference mode): the store writes into it.
        with torch.inference_mode(False):
            return torch.empty(
                (g.layers, 2, g.kv_heads, capacity, g.head_dim), dtype=g.dtype, device=self.device
            )  # buffer: [layers, 2, kv_heads, capacity, head_dim]

    def give_back(self, buffer: torch.Tensor) -> None:
        """Take back a buffer nothing reads or writes any more, keeping the newest up to `keep_bytes`."""
        with self._lock:
            self._free.append(buffer)
            while self._free and sum(_nbytes(b) for b in self._free) > self.keep_bytes:
                self._free.pop(0)


class KVReservation:
    """One request's admitted share of KV memory: up to `tokens` tokens, in a buffer that grows within it.

    The buffer starts with room for the prompt and the start of the answer; a longer answer grows it, never past the
    reservation. A request that starts from shared prefixes (`start`) is admitted for what follows them only: once
    `settle()` says they are filled, its buffer holds positions from `offset` on. `release()` gives the buffer, the
    prefixes and the share back; it is safe to call more than once, from any thread.
    """

    def __init__(
        self,
        buffers: KVBuffers | None,
        tokens: int,
        first_tokens: int,
        on_release: Callable[[int], None],
        *,
        start: PrefixStart | None = None,
        on_resize: Callable[[int], None] | None = None,
    ) -> None:
        self.tokens = round_up(tokens)
        self.offset = 0  # positions held by shared prefixes, once settled; the buffer starts at this one
        self.shared: tuple[torch.Tensor, ...] = ()  # their KV, root first (see attention.Segment)
        self.shared_tiers: tuple[str, ...] = ()  # where each of their blocks was read from
        self._buffers = buffers
        self._start = start  # until settled
        self._prefix: PrefixStart | None = None  # once settled
        self.nbytes = buffers.nbytes_for(tokens - (start.end if start else 0)) if buffers is not None else 0
        self._first = min(first_tokens, self.tokens)
        self._buffer: torch.Tensor | None = None  # taken when first asked for, once the offset is known
        self._on_release: Callable[[int], None] | None = on_release
        self._on_resize = on_resize
        self._on_way: Callable[[], None] | None = None  # see on_its_way()
        self._lock = threading.Lock()

    @property
    def buffer(self) -> torch.Tensor | None:
        """Return the buffer (`[layers, 2, kv_heads, capacity, head_dim]`, position p at index p - offset), or None
        for a model without one and after release."""
        with self._lock:
            if self._buffer is None and self._buffers is not None and self._on_release is not None:
                assert self._start is None, "settle() before the buffer is first used"
                own = self.tokens - self.offset
                self._buffer = self._buffers.take(max(self._first - self.offset, 1), own)
            return self._buffer

    def on_its_way(self, gone: Callable[[], None]) -> None:
        """Mark the request on its way to the model thread: `arrive()` ends that, or else `release()`, which calls
        `gone`."""
        with self._lock:
            self._on_way = gone

    def arrive(self) -> bool:
        """End the way to the model thread; return whether the request was on it (True once at most)."""
        with self._lock:
            was, self._on_way = self._on_way is not None, None
        return was

    async def settle(self) -> int:
        """Wait until the shared prefixes are filled; return the positions they hold. When a fill failed, the
        request goes on from its own buffer alone, counted for its whole prompt (over the budget if need be: it was
        admitted, and is not sent back to wait)."""
        start = self._start
        if start is None:
            return 0
        if await start.settle():
            chain = start.prefix.chain()
            with self._lock:
                self.offset = start.end
                self.shared = tuple(run for link in chain for run in link.kv)
                self.shared_tiers = tuple(tier for link in chain for tier in link.tiers)
                self._prefix, self._start = start, None
            return self.offset
        with self._lock:
            self._start = None
            old = self.nbytes
            if self._buffers is not None:
                self.nbytes = self._buffers.nbytes_for(self.tokens)
        if self._on_resize is not None:
            self._on_resize(self.nbytes - old)
        return 0

    def load(self, blocks: Sequence[torch.Tensor]) -> None:
        """Put `blocks` (the first at position `offset`; the last may be partial) into the buffer's leading
        positions; blocks fetched there already stay."""
        buffer = self.buffer
        assert buffer is not None, "only a model with KV buffers takes cached blocks"
        start = 0
        for block in blocks:
            slot = buffer[:, :, :, start : start + block.shape[3]]
            if block.data_ptr() != slot.data_ptr() or block.stride() != slot.stride():
                slot.copy_(block, non_blocking=True)
            start += block.shape[3]

    def ensure(self, tokens: int, filled: int) -> torch.Tensor:
        """Return the buffer with room for positions up to `tokens`, growing it (keeping positions up to `filled`)
        if needed."""
        buffer = self.buffer
        assert buffer is not None and self._buffers is not None, "no buffer to grow"
        need, kept = tokens - self.offset, filled - self.offset
        if need <= buffer.shape[3]:
            return buffer
        if tokens > self.tokens:
            raise RuntimeError(f"a request reserved {self.tokens} tokens of KV memory and needs {tokens}")
        own = self.tokens - self.offset
        grown = self._buffers.take(min(max(need, 2 * buffer.shape[3]), own), own)
        grown[:, :, :, :kept].copy_(buffer[:, :, :, :kept])
        self._buffers.give_back(buffer)
        self._buffer = grown
        return grown

    def release(self) -> None:
        """Give the buffer back for reuse, drop the shared prefixes, and give the share back to admission."""
        with self._lock:
            on_release, self._on_release = self._on_release, None
            buffer, self._buffer = self._buffer, None
            start, self._start = self._start, None
            prefix, self._prefix = self._prefix, None
            on_way, self._on_way = self._on_way, None
            self.shared = ()
        if on_way is not None:
            on_way()
        if on_release is None:
            return
        if buffer is not None and self._buffers is not None:
            self._buffers.give_back(buffer)
        for held in (start, prefix):
            if held is not None:
                held.release()
        on_release(self.nbytes)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()
