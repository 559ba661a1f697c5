"""The tier interface every storage level implements, and what tiers report about themselves."""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Generic, TypeVar, cast

import torch

from prefixgate.policies import Policy
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep
from prefixgate.store.keys import BlockKey


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One cached block as inspection shows it."""

    key: BlockKey
    tier: str
    tokens: int
    nbytes: int
    tenant: str
    parent: BlockKey | None
    created: float  # wall-clock seconds
    last_access: float | None  # the policy clock's seconds
    expires_at: float | None  # the policy clock's seconds
    hits: int
    pinned: bool
    retained_until: float | None  # the policy clock's seconds it is kept at least until; None: by the policy alone


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's occupancy and counters."""

    name: str
    entries: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    expirations: int
    promotions: int
    demotions: int
    corrupt: int
    dropped_writes: int  # blocks not written to this tier because its writer was too far behind
    failed_writes: int  # blocks the tier failed to write (a full or failing disk)
    failed_reads: int  # reads that failed (a damaged file): misses
    set_aside: int  # damaged stores moved aside at start, an empty one opened in their place
    problem: str | None = None  # why the tier fails now (its last error); None while it works


@dataclass(slots=True)
class TierCounters:
    """Running counts of what happened in one tier; the store and the tier both add to them."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    promotions: int = 0
    demotions: int = 0
    corrupt: int = 0
    dropped_writes: int = 0
    failed_writes: int = 0
    failed_reads: int = 0
    set_aside: int = 0

    def add(self, name: str, amount: int = 1) -> None:
        """Add `amount` to the counter `name`, atomically with other adds."""
        with _COUNTER_LOCK:
            setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, int]:
        """Return every counter by name."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


_COUNTER_LOCK = threading.Lock()
_MAX_DOUBLINGS = 30  # of a backoff: past this, it is at its cap anyway


class TierHealth:
    """Whether a tier works, and when to try it again after it failed: exponential backoff on an injected clock.

    While it fails, the tier answers misses and takes no writes, instead of making every request wait for, or log, the
    same failure (Redis that does not answer, a disk that is full or damaged).
    """

    def __init__(self, clock: Callable[[], float], first: float, cap: float) -> None:
        self._clock = clock
        self._first = first
        self._cap = cap
        self._lock = threading.Lock()
        self._failures = 0  # failed tries in a row
        self._retry_at = 0.0

    @property
    def available(self) -> bool:
        return self._failures == 0

    def usable(self) -> bool:
        """Return whether to use the tier now: it worked last time, or its backoff is over (this is a try)."""
        with self._lock:
            return self._failures == 0 or self._clock() >= self._retry_at

    def failed(self) -> float | None:
        """Record a failure; return the next backoff, or None when it repeats a failure already recorded."""
        with self._lock:
            now = self._clock()
            if self._failures and now < self._retry_at:
                return None  # begun before the tier was marked down (in another thread): no new try failed
            self._failures += 1
            delay = min(self._cap, self._first * 2.0 ** min(self._failures - 1, _MAX_DOUBLINGS))
            self._retry_at = now + delay
            return delay

    def succeeded(self) -> bool:
        """Record a success; return whether the tier was failing until now."""
        with self._lock:
            was_down = self._failures > 0
            self._failures = 0
            return was_down


V = TypeVar("V")


class Held(Generic[V]):
    """The blocks a tier holds, by key, and the held children of each block, kept in step with every change.

    The children index is what finds a block that continues a cached prefix without scanning the tier: each block
    records its parent, so the blocks after a given one are the children held under it, newest last. The whole blocks
    among them are indexed apart as well: many prompts on one prefix leave it thousands of tails (their partial last
    blocks), and a look for its forks or its newest continuations reads a few of them, not all.
    """

    __slots__ = ("_children", "_is_whole", "_parents", "_values", "_whole")

    def __init__(self, is_whole: Callable[[V], bool]) -> None:
        self._is_whole = is_whole  # whether a held value is a whole block (not a tail)
        self._values: dict[BlockKey, V] = {}
        self._parents: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, dict[BlockKey, None]] = {}
        self._whole: dict[BlockKey, dict[BlockKey, None]] = {}  # the whole blocks among each block's children

    def get(self, key: BlockKey) -> V | None:
        """Return what is held under `key`, or None."""
        return self._values.get(key)

    def set(self, key: BlockKey, parent: BlockKey | None, value: V) -> None:
        """Hold `value` under `key`, a child of `parent` (None for a prefix's first block)."""
        if key not in self._values:
            self._parents[key] = parent
            if parent is not None:
                self._children.setdefault(parent, {})[key] = None
                if self._is_whole(value):
                    self._whole.setdefault(parent, {})[key] = None
        self._values[key] = value

    def pop(self, key: BlockKey) -> V | None:
        """Stop holding `key`; return what was held, or None."""
        value = self._values.pop(key, None)
        if value is None:
            return None
        parent = self._parents.pop(key)
        if parent is not None:
            for index in (self._children, self._whole):
                siblings = index.get(parent)
                if siblings is not None and key in siblings:
                    del siblings[key]
                    if not siblings:
                        del index[parent]
        return value

    def clear(self) -> None:
        """Hold nothing."""
        self._values.clear()
        self._parents.clear()
        self._children.clear()
        self._whole.clear()

    def children(self, parent: BlockKey, *, newest: int | None = None, whole: bool = False) -> list[BlockKey]:
        """Return the held blocks whose parent is `parent`, newest last: the `newest` newest of them where given,
        only the whole blocks with `whole`."""
        held = (self._whole if whole else self._children).get(parent, {})
        if newest is None or newest >= len(held):
            return list(held)
        return list(itertools.islice(reversed(held), newest))[::-1]

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._values)


class Tier(ABC):
    """One storage level: holds whole blocks of one layout within a byte budget it never exceeds.

    A tier acts; its policy decides. The tiered store asks the policy for victims and moves blocks between
    tiers, so no tier knows the others.
    """

    persistent: bool = False  # keeps blocks across restarts, and is written through on every insert

    def __init__(
        self, name: str, layout: BlockLayout, capacity_bytes: int, policy: Policy, clock: Callable[[], float]
    ) -> None:
        self.name = name
        self.layout = layout
        self.capacity_bytes = max(0, capacity_bytes)
        self.policy = policy
        self.clock = clock  # the policy's clock, in the time base of `Block.created`
        self.counters = TierCounters()
        self.problem: str | None = None  # why the tier fails now; None while it works

    @property
    def capacity_blocks(self) -> int:
        """Return how many blocks fit the budget."""
        return self.capacity_bytes // self.layout.nbytes

    def can_hold(self, count: int) -> bool:
        """Return whether `count` blocks fit this tier's budget at all (when empty)."""
        return 0 < count <= self.capacity_blocks

    def has_room(self) -> bool:
        """Return whether one more block fits without evicting."""
        return len(self) < self.capacity_blocks

    def touch(self, key: BlockKey) -> None:
        """Tell the policy the block was used."""
        self.policy.touch(key)

    def victim(self) -> BlockKey | None:
        """Return the block the policy would evict next, if any may be."""
        return cast(BlockKey | None, self.policy.victim())

    def expired(self) -> list[BlockKey]:
        """Return the blocks whose time is up."""
        return cast(list[BlockKey], self.policy.expired())

    def stats(self) -> TierStats:
        """Return a snapshot of occupancy and counters."""
        return TierStats(
            name=self.name,
            entries=len(self),
            bytes=len(self) * self.layout.nbytes,
            capacity=self.capacity_bytes,
            **self.counters.as_dict(),
            problem=self.problem,
        )

    @abstractmethod
    def __len__(self) -> int:
        """Return the number of blocks held."""

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Return whether the block is held (without verifying it)."""

    @abstractmethod
    def get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor | None = None) -> Block | None:
        """Return a copy of the block if held and verified against `tokens`, else None.

        The copy is written into `out` when given (a block-shaped tensor, possibly a view into a larger one), so a
        prefix can be assembled in place with one copy per block. A held block that fails verification is
        removed and counted as corrupt.
        """

    @abstractmethod
    def put(self, block: Block, keep: Keep = BY_POLICY) -> bool:
        """Hold `block`, replacing any block of the same key; the caller has made room. Return whether it was taken.

        `keep.ttl` overrides the policy's default lifetime. Only a tier that writes in the background refuses a
        block, and counts it in `dropped_writes`: when its writer is too far behind.
        """

    @abstractmethod
    def attrs(self, key: BlockKey) -> Keep | None:
        """Return how the block is kept, or None when it is not held."""

    @abstractmethod
    def retain(self, key: BlockKey, until: float) -> bool:
        """Keep the block at least until `until` (wall clock; a longer retention stays); return whether it is held."""

    @abstractmethod
    def remove(self, key: BlockKey) -> bool:
        """Drop the block; return whether it was held."""

    @abstractmethod
    def pin(self, key: BlockKey, pinned: bool) -> bool:
        """Set whether the block is pinned (never evicted, still expires); return whether it is held."""

    @abstractmethod
    def entry(self, key: BlockKey) -> EntryInfo | None:
        """Return what is known about one held block."""

    @abstractmethod
    def keys(self) -> list[BlockKey]:
        """Return the keys of every held block."""

    @abstractmethod
    def children(
        self, parent: BlockKey, *, newest: int | None = None, whole: bool = False
    ) -> list[tuple[BlockKey, tuple[int, ...]]]:
        """Return the held blocks that follow `parent` in a prefix, with their token ids, the newest last: the `newest`
        newest of them where given, only whole blocks (not tails) with `whole`."""

    @abstractmethod
    def peek(self, key: BlockKey) -> Block | None:
        """Return the block unverified; its tensor may be a view, valid only until the tier next changes."""

    def clear(self) -> int:
        """Drop every block; return how many were dropped."""
        keys = self.keys()
        for key in keys:
            self.remove(key)
        return len(keys)

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to release
        """Release what the tier holds open."""

    def _track(self, key: BlockKey, created: float, keep: Keep) -> None:
        """Insert the block into the policy: what is left of its own lifetime and of its retention, so moving between
        tiers neither extends nor shortens them."""
        now = self.clock()
        ttl = None if keep.ttl is None else max(created + keep.ttl - now, 1e-9)
        retain = None if keep.retain_until is None or keep.retain_until <= now else keep.retain_until - now
        self.policy.insert(key, ttl=ttl, pinned=keep.pinned, retain=retain)

    def _retain(self, key: BlockKey, until: float) -> None:
        """Extend the policy's retention of a held block."""
        seconds = until - self.clock()
        if seconds > 0:
            self.policy.retain(key, seconds)
