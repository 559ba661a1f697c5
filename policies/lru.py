"""Recency policies: evict the least recently used entry ("lru", "lru+ttl") or the oldest one ("fifo")."""

import time
from collections.abc import Hashable
from typing import ClassVar

from prefixgate.policies.key_order import RankOrder
from prefixgate.policies.policy import Clock, Entry, Policy


class LRUPolicy(Policy):
    """Evict the unpinned entry inserted or touched least recently; expire by ttl and idle_ttl when given."""

    name: ClassVar[str] = "lru"

    def __init__(
        self, *, clock: Clock = time.monotonic, ttl: float | None = None, idle_ttl: float | None = None
    ) -> None:
        super().__init__(clock=clock, ttl=ttl, idle_ttl=idle_ttl)
        # Only unpinned keys, by their latest insert or touch: the front is the victim in O(1).
        self._recency = RankOrder()

    def _victim(self) -> Hashable | None:
        """Return the unpinned key used least recently, without removing it; None when there is none."""
        return self._recency.first()

    def _enqueue(self, key: Hashable, entry: Entry) -> None:
        self._recency.add(key, self._rank(entry))

    def _dequeue(self, key: Hashable) -> None:
        self._recency.discard(key)

    def _requeue(self, key: Hashable, entry: Entry) -> None:
        self._recency.add(key, self._rank(entry))

    def _rank(self, entry: Entry) -> int:
        return entry.used_rank


class LRUTTLPolicy(LRUPolicy):
    """Evict in LRU order and expire by ttl and idle_ttl, at least one of which must be set."""

    name: ClassVar[str] = "lru+ttl"
    needs_expiry: ClassVar[bool] = True


class FIFOPolicy(LRUPolicy):
    """Evict the unpinned entry inserted longest ago, hits or not; expire by ttl and idle_ttl when given."""

    name: ClassVar[str] = "fifo"

    def _requeue(self, key: Hashable, entry: Entry) -> None:
        pass  # a hit does not move an entry in insertion order

    def _rank(self, entry: Entry) -> int:
        return entry.inserted_rank
