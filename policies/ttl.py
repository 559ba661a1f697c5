"""The "ttl" policy: evict the entry closest to expiring, so eviction only brings expiry forward."""

import time
from collections.abc import Hashable
from typing import ClassVar

from prefixgate.policies.key_order import DeadlineOrder, RankOrder
from prefixgate.policies.policy import Clock, Entry, Policy


class TTLPolicy(Policy):
    """Evict the unpinned entry whose deadline comes soonest; expire by ttl and idle_ttl, at least one set."""

    name: ClassVar[str] = "ttl"
    needs_expiry: ClassVar[bool] = True

    def __init__(
        self, *, clock: Clock = time.monotonic, ttl: float | None = None, idle_ttl: float | None = None
    ) -> None:
        super().__init__(clock=clock, ttl=ttl, idle_ttl=idle_ttl)
        # An entry's deadline is the sooner of two, so the soonest over all entries is the sooner of two
        # fronts: unpinned keys by absolute deadline, and unpinned keys by last use (idle deadline order, as
        # the idle lifetime is one value for all). One heap on the combined deadline was rejected: a hit moves
        # the idle deadline, so every hit would cost O(log n) and leave a stale item.
        self._by_deadline = DeadlineOrder()
        self._by_use = RankOrder()

    def _victim(self) -> Hashable | None:
        """Return the unpinned key that expires soonest, without removing it; None when there is none."""
        candidates = [key for key in (self._by_deadline.first(), self._by_use.first()) if key is not None]
        if not candidates:
            return None
        # needs_expiry gives every entry a deadline (ttl an absolute one to all, idle_ttl an idle one), so
        # no entry is left without one to order after the rest.
        return min(candidates, key=self._expiry_order)

    def _enqueue(self, key: Hashable, entry: Entry) -> None:
        if entry.deadline is not None:
            self._by_deadline.add(key, entry.deadline, entry.inserted_rank)
        if self._idle_ttl is not None:
            self._by_use.add(key, entry.used_rank)

    def _dequeue(self, key: Hashable) -> None:
        self._by_deadline.discard(key)
        self._by_use.discard(key)

    def _requeue(self, key: Hashable, entry: Entry) -> None:
        # A hit pushes back only the idle deadline; the absolute one is fixed at insert.
        if self._idle_ttl is not None:
            self._by_use.add(key, entry.used_rank)
