"""The device and host tiers: a preallocated pool of block slots with a free list."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from prefixgate.errors import StoreError
from prefixgate.policies import Policy
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep
from prefixgate.store.keys import BlockKey
from prefixgate.store.tier import EntryInfo, Held, Tier

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as PyTorch registers memory


def pins_pool(pool: torch.device, model: torch.device) -> bool:
    """Return whether a pool on `pool` is pinned: CPU memory that blocks move to and from a CUDA model through."""
    # A pool on the GPU cannot be pinned (PyTorch refuses), and pinning for a model on the CPU buys nothing.
    return pool.type == "cpu" and model.type == "cuda"


@dataclass(slots=True)
class _Slot:
    index: int
    block: Block  # its kv is a view into the pool
    keep: Keep


class MemoryTier(Tier):
    """Blocks in one preallocated tensor on a device: no allocation per block, no fragmentation.

    The device tier lives on the model's device; the host tier on CPU memory, pinned (`pin_memory`, see
    `pins_pool`) when the model is on a GPU, so copies to it run asynchronously.
    """

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        capacity_bytes: int,
        policy: Policy,
        *,
        clock: Callable[[], float],
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        super().__init__(name, layout, capacity_bytes, policy, clock)
        self.device = torch.device(device)
        slots = self.capacity_blocks
        # pool: [slots, layers, 2, kv_heads, block_size, head_dim]
        self._pool = torch.empty((slots, *layout.shape), dtype=layout.dtype, device=self.device)
        # Pinned by registering the pool's own pages, not by allocating it with pin_memory=True: PyTorch's pinned
        # allocator rounds every allocation up to a power of two, so a 10 GiB host tier would lock 16 GiB of RAM.
        # The finalizer unregisters them on close, or when the tier is dropped unclosed (a failed open).
        self._unpin: weakref.finalize[[], MemoryTier] | None = None
        if pin_memory and slots > 0:
            self._unpin = weakref.finalize(self, _pin(self._pool, name))
            self._unpin.atexit = False  # at exit the process's end releases the pages anyway
        # Pop from the end: the lowest slots are used first, which keeps a small working set warm in caches.
        self._free = list(range(slots - 1, -1, -1))
        self._slots: Held[_Slot] = Held()

    def __len__(self) -> int:
        return len(self._slots)

    def contains(self, key: BlockKey) -> bool:
        return key in self._slots

    def get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor | None = None) -> Block | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.block.tokens != tuple(tokens):
            # Same chained hash, other tokens: a collision or a forged key. Never serve it.
            self.remove(key)
            self.counters.add("corrupt")
            return None
        self.policy.touch(key)
        block = slot.block
        kv = block.kv.clone() if out is None else out.copy_(block.kv, non_blocking=out.is_cuda and block.kv.is_pinned())
        return Block(block.key, block.tokens, kv, block.parent, block.tenant, block.created)

    def peek(self, key: BlockKey) -> Block | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.block

    def attrs(self, key: BlockKey) -> Keep | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.keep

    def retain(self, key: BlockKey, until: float) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.keep = slot.keep.merged(Keep(retain_until=until))
        self._retain(key, until)
        return True

    def put(self, block: Block, keep: Keep = BY_POLICY) -> bool:
        self.layout.check(block)
        slot = self._slots.get(block.key)
        if slot is None:
            assert self._free, f"{self.name} tier is full: the store must make room first"
            index = self._free.pop()
        else:
            index = slot.index
        view = self._pool[index]  # kv: [layers, 2, kv_heads, block_size, head_dim]
        # Asynchronous only host-to-device: the CPU may read a host copy right away, so copies to it block.
        view.copy_(block.kv, non_blocking=view.is_cuda and block.kv.is_pinned())
        stored = Block(block.key, block.tokens, view, block.parent, block.tenant, block.created)
        self._slots.set(block.key, block.parent, _Slot(index, stored, keep))
        self._track(block.key, block.created, keep)
        return True

    def remove(self, key: BlockKey) -> bool:
        slot = self._slots.pop(key)
        if slot is None:
            return False
        self._free.append(slot.index)
        self.policy.remove(key)
        return True

    def pin(self, key: BlockKey, pinned: bool) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.keep = replace(slot.keep, pinned=pinned)
        if pinned:
            self.policy.pin(key)
        else:
            self.policy.unpin(key)
        return True

    def keys(self) -> list[BlockKey]:
        return list(self._slots)

    def children(self, parent: BlockKey) -> list[tuple[BlockKey, tuple[int, ...]]]:
        found = [(key, self._slots.get(key)) for key in self._slots.children(parent)]
        return [(key, slot.block.tokens) for key, slot in found if slot is not None]

    def entry(self, key: BlockKey) -> EntryInfo | None:
        slot = self._slots.get(key)
        times = self.policy.info(key)
        if slot is None or times is None:
            return None
        block = slot.block
        return EntryInfo(
            key=key,
            tier=self.name,
            tokens=len(block.tokens),
            nbytes=self.layout.nbytes,
            tenant=block.tenant,
            parent=block.parent,
            created=block.created,
            last_access=times.last_access,
            expires_at=times.expires_at,
            hits=times.hits,
            pinned=slot.keep.pinned,
            retained_until=times.retained_until,
        )

    def close(self) -> None:
        if self._unpin is not None:
            self._unpin()


def _pin(pool: torch.Tensor, name: str) -> Callable[[], None]:
    """Page-lock the pool's memory for CUDA where it lies; return what unlocks it."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    pointer, size = pool.data_ptr(), pool.untyped_storage().nbytes()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(pointer, size, _HOST_REGISTER_PORTABLE))
    except RuntimeError as error:
        # Raised, not logged and served unpinned: the failed call stays CUDA's "last error" in this thread, and
        # the next kernel launch checked there would fail with it, far from its cause.
        raise StoreError(
            f"could not pin the {name} tier's {size} bytes of host memory for CUDA ({error}); give the {name} tier "
            "a smaller budget, one this machine can lock"
        ) from error

    def unpin() -> None:
        # Copies out of the pool may still be in flight (they are asynchronous): let them finish first.
        torch.cuda.synchronize()
        torch.cuda.check_error(cudart.cudaHostUnregister(pointer))

    return unpin
