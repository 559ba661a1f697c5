"""KV buffers: the memory each running request's cache lives in, reserved at admission and reused afterwards.

A buffer is one tensor `[layers, 2, kv_heads, capacity, head_dim]`. A request reserves its share of the KV budget
(its prompt plus every token it may generate), borrows a buffer, the store fetches the cached prefix into its leading
positions, and the model thread runs the request's cache in that same memory: the prefix is copied once, from the
store straight to where attention reads it. When the request ends the buffer comes back for the next one. On a CPU
that reuse matters: filling memory the process has not touched yet costs a page fault per 4 KiB, and a used buffer
fills about four times faster (SmolLM2 at 4k tokens, 180 MB: about 30 ms instead of 130 ms on a 2-core machine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from prefixgate.backends.backend import KVGeometry

GRANULE = 256  # capacities are multiples of this many tokens, so buffers fit many prompt lengths


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
    reservation. `release()` gives the buffer and the share back; it is safe to call more than once, from any thread.
    """

    def __init__(
        self, buffers: KVBuffers | None, tokens: int, first_tokens: int, on_release: Callable[[], None]
    ) -> None:
        self.tokens = round_up(tokens)
        self.nbytes = buffers.nbytes_for(tokens) if buffers is not None else 0
        self._buffers = buffers
        # A model whose cache is not per-token K and V keeps transformers' own cache: it has no buffer.
        self._buffer = buffers.take(min(first_tokens, self.tokens), self.tokens) if buffers is not None else None
        self._on_release: Callable[[], None] | None = on_release
        self._lock = threading.Lock()

    @property
    def buffer(self) -> torch.Tensor | None:
        """Return the buffer (`[layers, 2, kv_heads, capacity, head_dim]`), or None for a model without one."""
        return self._buffer

    def load(self, blocks: Sequence[torch.Tensor]) -> None:
        """Put `blocks` (block 0 first; the last may be partial) into the buffer's leading positions; blocks fetched
        there already stay."""
        assert self._buffer is not None, "only a model with KV buffers takes cached blocks"
        start = 0
        for block in blocks:
            slot = self._buffer[:, :, :, start : start + block.shape[3]]
            if block.data_ptr() != slot.data_ptr() or block.stride() != slot.stride():
                slot.copy_(block, non_blocking=True)
            start += block.shape[3]

    def ensure(self, tokens: int, filled: int) -> torch.Tensor:
        """Return the buffer with room for `tokens` tokens, growing it (keeping its first `filled`) if needed."""
        assert self._buffer is not None and self._buffers is not None, "no buffer to grow"
        if tokens <= self._buffer.shape[3]:
            return self._buffer
        if tokens > self.tokens:
            raise RuntimeError(f"a request reserved {self.tokens} tokens of KV memory and needs {tokens}")
        grown = self._buffers.take(min(max(tokens, 2 * self._buffer.shape[3]), self.tokens), self.tokens)
        grown[:, :, :, :filled].copy_(self._buffer[:, :, :, :filled])
        self._buffers.give_back(self._buffer)
        self._buffer = grown
        return grown

    def release(self) -> None:
        """Give the buffer back for reuse and the share back to admission."""
        with self._lock:
            on_release, self._on_release = self._on_release, None
            buffer, self._buffer = self._buffer, None
        if on_release is None:
            return
        if buffer is not None and self._buffers is not None:
            self._buffers.give_back(buffer)
        on_release()


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()
