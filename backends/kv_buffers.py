"""KV buffers: the memory a request's cache lives in, lent out to fetch a cached prefix into and reused afterwards.

A buffer is one tensor `[layers, 2, kv_heads, capacity, head_dim]`. The engine borrows one, the store fetches the
cached prefix into its leading positions, and the job that receives those blocks runs its cache in that same memory:
the prefix is copied once, from the store straight to where attention reads it. When the job ends the buffer comes
back for the next request. On a CPU that reuse matters: filling memory the process has not touched yet costs a page
fault per 4 KiB, and a used buffer fills about four times faster (SmolLM2 at 4k tokens, 180 MB: about 30 ms instead
of 130 ms on a 2-core machine).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from prefixgate.backends.backend import KVGeometry

_GRANULE = 256  # capacities are multiples of this many tokens, so buffers fit many prompt lengths


class KVBuffers:
    """Hand out KV buffers and keep up to `keep_bytes` of returned ones for reuse. Thread-safe."""

    def __init__(self, geometry: KVGeometry, device: torch.device, *, keep_bytes: int = 1 << 30) -> None:
        self.geometry = geometry
        self.device = device
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []  # returned buffers, oldest first
        # Lent buffers by address, until a job adopts them or they come back unused.
        self._lent: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def lend(self, tokens: int) -> torch.Tensor:
        """Return a buffer for at least `tokens` tokens to fetch a prefix into; see `adopt_or_take`."""
        buffer = self._take(tokens)
        with self._lock:
            self._lent[buffer.data_ptr()] = buffer
        return buffer

    def adopt_or_take(self, blocks: Sequence[torch.Tensor], tokens: int) -> torch.Tensor:
        """Return a buffer whose leading positions hold `blocks` (block 0 first), for at least `tokens` tokens.

        When the blocks are the leading slices of a lent buffer, that buffer is adopted as it is, with no copy;
        otherwise they are copied into a buffer taken from the free ones or allocated. The buffer is the caller's
        alone until `give_back`: a lent buffer is adopted once, so a second reader of the same blocks gets a copy.
        """
        if blocks:
            with self._lock:
                buffer = self._lent.get(blocks[0].data_ptr())
                if buffer is not None and self._leads(buffer, blocks):
                    del self._lent[buffer.data_ptr()]
                    return buffer
        buffer = self._take(tokens)
        size = self.geometry.block_size
        for index, block in enumerate(blocks):
            buffer[:, :, :, index * size : (index + 1) * size].copy_(block, non_blocking=True)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Take back a buffer nothing reads or writes any more, keeping the newest up to `keep_bytes`.

        That is an adopted buffer whose job has ended, or a lent one its borrower fetched no blocks into.
        """
        with self._lock:
            self._lent.pop(buffer.data_ptr(), None)
            self._free.append(buffer)
            while self._free and sum(_nbytes(b) for b in self._free) > self.keep_bytes:
                self._free.pop(0)

    def _take(self, tokens: int) -> torch.Tensor:
        capacity = -(-max(tokens, 1) // _GRANULE) * _GRANULE
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.shape[3] >= capacity]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].shape[3]))
        g = self.geometry
        # An ordinary tensor even when taken on the model's thread (inference mode): the store writes into it.
        with torch.inference_mode(False):
            return torch.empty(
                (g.layers, 2, g.kv_heads, capacity, g.head_dim), dtype=g.dtype, device=self.device
            )  # buffer: [layers, 2, kv_heads, capacity, head_dim]

    def _leads(self, buffer: torch.Tensor, blocks: Sequence[torch.Tensor]) -> bool:
        size = self.geometry.block_size
        if len(blocks) * size > buffer.shape[3]:
            return False
        for index, block in enumerate(blocks):
            slot = buffer[:, :, :, index * size : (index + 1) * size]
            if block.data_ptr() != slot.data_ptr() or block.stride() != slot.stride() or block.shape != slot.shape:
                return False
        return True


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()
