"""The device and host tiers: a preallocated pool of block slots with a free list, lent in place to running requests.

The pool is laid out token-major per layer, `[layers, 2, kv_heads, slots * block_size, head_dim]`: slot i holds
positions `[i * block_size, (i + 1) * block_size)` of every layer's K and V. A run of consecutive slots is then one
view with the shape of a KV cache, and a prefix whose blocks lie in consecutive slots is read by attention in place,
as it lies. A block goes into the slot after its parent's when that one is free, so a prompt's blocks, stored in
order, form one run while the tier has room; a prefix stored in pieces (into the slots evictions free one by one) is
gathered into one run before it is first lent (`gather`). A borrowed slot (`borrow`) is read by running requests: it
is never evicted, and when its block is removed (a flush, a delete, expiry) the slot stays out of use until the last
reader gives it back.

Within each slot, K and V lie token by token, or in the `SlotOrder` the tier is given (the attention kernel's, so
that a prefix lent in place is read as it lies): lent views are in that order, while every block the tier takes
(`put`) or gives (`get`, `peek`) is in token order.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from prefixgate.errors import StoreError
from prefixgate.policies import Policy
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep, SlotOrder
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


@dataclass(slots=True)
class _Readers:
    key: BlockKey
    count: int = 0
    removed: bool = False  # the block left the tier while read: the slot is freed when the last reader ends


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
        order: SlotOrder | None = None,
    ) -> None:
        super().__init__(name, layout, capacity_bytes, policy, clock)
        self.device = torch.device(device)
        self.order = order  # how each slot is laid out; None: token by token
        slots = self.capacity_blocks
        layers, two, kv_heads, self._block_size, head_dim = layout.shape
        # pool: [layers, 2, kv_heads, slots * block_size, head_dim]
        self._pool = torch.empty(
            (layers, two, kv_heads, slots * self._block_size, head_dim), dtype=layout.dtype, device=self.device
        )
        # Pinned by registering the pool's own pages, not by allocating it with pin_memory=True: PyTorch's pinned
        # allocator rounds every allocation up to a power of two, so a 10 GiB host tier would lock 16 GiB of RAM.
        # The finalizer unregisters them on close, or when the tier is dropped unclosed (a failed open).
        self._unpin: weakref.finalize[[], MemoryTier] | None = None
        if pin_memory and slots > 0:
            self._unpin = weakref.finalize(self, _pin(self._pool, name))
            self._unpin.atexit = False  # at exit the process's end releases the pages anyway
        self._free = list(range(slots))  # ascending
        self._next = 0  # where the next block without a free slot after its parent goes: the first free one from here
        self._slots: Held[_Slot] = Held(lambda slot: len(slot.block.tokens) == self._block_size)
        self._holders: dict[int, BlockKey] = {}  # the block in each occupied slot
        self._readers: dict[int, _Readers] = {}  # borrowed slots by index

    def __len__(self) -> int:
        return len(self._slots)

    def has_room(self) -> bool:
        return bool(self._free)  # slots of removed blocks still read are in use, though no entry holds them

    def contains(self, key: BlockKey) -> bool:
        return key in self._slots

    def get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor | None = None) -> Block | None:
        slot = self._verified(key, tokens)
        if slot is None:
            return None
        block = slot.block
        if self.order is not None:
            kv = self.order.read(block.kv, torch.empty_like(block.kv) if out is None else out)
        elif out is None:
            kv = block.kv.clone()
        else:
            kv = out.copy_(block.kv, non_blocking=out.is_cuda and block.kv.is_pinned())
        return Block(block.key, block.tokens, kv, block.parent, block.tenant, block.created)

    def peek(self, key: BlockKey) -> Block | None:
        """Return the block as it lies, a view into the pool (valid while the pool does not change); in the tier's
        order, a copy in token order."""
        slot = self._slots.get(key)
        if slot is None or self.order is None:
            return None if slot is None else slot.block
        block = slot.block
        return replace(block, kv=self.order.read(block.kv, torch.empty_like(block.kv)))

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
            index = self._allocate(block.parent)
        else:
            index = slot.index
        view = self.span(index, 1)  # kv: [layers, 2, kv_heads, block_size, head_dim]
        # A slot being read keeps its K and V: a block of the same key holds the same tokens' K and V.
        if index not in self._readers:
            if self.order is not None:
                self.order.write(view, block.kv)
            else:
                # Asynchronous only host-to-device: the CPU may read a host copy right away, so copies to it block.
                view.copy_(block.kv, non_blocking=view.is_cuda and block.kv.is_pinned())
        stored = Block(block.key, block.tokens, view, block.parent, block.tenant, block.created)
        self._slots.set(block.key, block.parent, _Slot(index, stored, keep))
        self._holders[index] = block.key
        self._track(block.key, block.created, keep)
        return True

    def remove(self, key: BlockKey) -> bool:
        slot = self._slots.pop(key)
        if slot is None:
            return False
        del self._holders[slot.index]
        readers = self._readers.get(slot.index)
        if readers is not None:
            readers.removed = True
        else:
            bisect.insort(self._free, slot.index)
        self.policy.remove(key)
        return True

    def pin(self, key: BlockKey, pinned: bool) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        slot.keep = replace(slot.keep, pinned=pinned)
        if pinned:
            self.policy.pin(key)
        elif slot.index not in self._readers:  # a block being read stays pinned until its last reader ends
            self.policy.unpin(key)
        return True

    def borrow(self, key: BlockKey, tokens: Sequence[int]) -> int | None:
        """Lend the block in place to a reader: return its slot (read it with `span`, give it back with `give_back`),
        or None when it is not held here or fails verification (then it is removed and counted corrupt).

        Until given back the block is never evicted, and its slot is not reused even if the block is removed.
        """
        slot = self._verified(key, tokens)
        if slot is None:
            return None
        readers = self._readers.setdefault(slot.index, _Readers(key))
        readers.count += 1
        self.policy.pin(key)
        return slot.index

    def give_back(self, index: int) -> None:
        """End one reader's loan of slot `index`; after the last, the block is kept (or the slot freed) as if never
        lent."""
        readers = self._readers[index]
        readers.count -= 1
        if readers.count:
            return
        del self._readers[index]
        if readers.removed:
            bisect.insort(self._free, index)
            return
        slot = self._slots.get(readers.key)
        if slot is not None and slot.index == index and not slot.keep.pinned:
            self.policy.unpin(readers.key)

    def gather(self, keys: Sequence[BlockKey]) -> None:
        """Move the blocks `keys` (a prefix's, in order) into consecutive slots, from where the first lies (or the
        last window that fits), unless one of them is not held, or they or the blocks in those slots are lent; the
        blocks there take the slots they leave. Costs up to three block copies per block out of place.
        """
        slots = [self._slots.get(key) for key in keys]
        if not slots or any(slot is None for slot in slots):
            return
        held = [slot for slot in slots if slot is not None]
        first = min(held[0].index, self.capacity_blocks - len(held))
        involved = {slot.index for slot in held} | set(range(first, first + len(held)))
        if any(index in self._readers for index in involved):
            return
        spare = torch.empty_like(self.span(0, 1))  # spare: [layers, 2, kv_heads, block_size, head_dim]
        for offset, slot in enumerate(held):
            if slot.index != first + offset:
                self._swap(slot.index, first + offset, spare)

    def lent(self) -> int:
        """Return how many slots running requests read now."""
        return len(self._readers)

    def span(self, first: int, count: int) -> torch.Tensor:
        """Return slots `first` to `first + count` (not included) as one view, in the tier's order:
        [layers, 2, kv_heads, count * block_size, head_dim]."""
        size = self._block_size
        return self._pool[:, :, :, first * size : (first + count) * size]

    def keys(self) -> list[BlockKey]:
        return list(self._slots)

    def children(
        self, parent: BlockKey, *, newest: int | None = None, whole: bool = False
    ) -> list[tuple[BlockKey, tuple[int, ...]]]:
        found = [(key, self._slots.get(key)) for key in self._slots.children(parent, newest=newest, whole=whole)]
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
        """Let go of the pool and every block in it: a closed tier holds no memory, whoever still references it (a
        closed server's app stays referenced from aiohttp's cache of middleware chains, say)."""
        if self._unpin is not None:
            self._unpin()
        layers, two, kv_heads, _, head_dim = self._pool.shape
        self._pool = self._pool.new_empty((layers, two, kv_heads, 0, head_dim))
        self._slots.clear()
        self._holders.clear()
        self._readers.clear()
        self._free.clear()

    def _verified(self, key: BlockKey, tokens: Sequence[int]) -> _Slot | None:
        """Return the block's slot, counting a use, if it holds `tokens`; a block that does not is removed."""
        slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.block.tokens != tuple(tokens):
            # Same chained hash, other tokens: a collision or a forged key. Never serve it.
            self.remove(key)
            self.counters.add("corrupt")
            return None
        self.policy.touch(key)
        return slot

    def _swap(self, here: int, there: int, spare: torch.Tensor) -> None:
        """Exchange what slots `here` and `there` hold (a block, or nothing), through `spare`."""
        held = {index: self._holders.pop(index, None) for index in (here, there)}
        spare.copy_(self.span(there, 1))
        self.span(there, 1).copy_(self.span(here, 1))
        self.span(here, 1).copy_(spare)
        for old, new in ((here, there), (there, here)):
            key = held[old]
            if key is None:  # nothing was there: the slot it goes to is the free one now
                self._free.remove(old)
                bisect.insort(self._free, new)
                continue
            slot = self._slots.get(key)
            assert slot is not None
            slot.index = new
            slot.block = replace(slot.block, kv=self.span(new, 1))
            self._holders[new] = key

    def _allocate(self, parent: BlockKey | None) -> int:
        """Take a free slot: the one after the parent's when free, so a prefix stays one run, else the first free
        one from where the last went."""
        after = self._slots.get(parent) if parent is not None else None
        if after is not None:
            place = bisect.bisect_left(self._free, after.index + 1)
            if place < len(self._free) and self._free[place] == after.index + 1:
                return self._free.pop(place)
        place = bisect.bisect_left(self._free, self._next)
        index = self._free.pop(place if place < len(self._free) else 0)
        self._next = index + 1
        return index


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
