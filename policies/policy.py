"""The policy contract: track entries by key and time, and answer which key goes next and which have expired.

A policy never touches storage. The store tells it what happened (`insert`, `touch`, `remove`, `pin`, `unpin`)
and asks it what to do (`victim`, `expired`); acting on the answer, then calling `remove`, is the store's job.
"""

import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from itertools import count
from typing import ClassVar, TypeAlias

from prefixgate.errors import ConfigError
from prefixgate.policies.key_order import DeadlineOrder

Clock: TypeAlias = Callable[[], float]
"""Seconds on a monotonic scale; injected so tests drive time instead of sleeping."""


@dataclass(frozen=True, slots=True)
class EntryTimes:
    """Describe one tracked entry: when it arrived, was last used and expires, and how often it was hit."""

    inserted_at: float
    last_access: float
    # The sooner of the absolute and the idle deadline, never before `retained_until`; None when it has neither.
    expires_at: float | None
    hits: int
    pinned: bool
    retained_until: float | None = None  # kept at least until then: see `Policy.retain`


@dataclass(slots=True)
class Entry:
    """Hold the state of one tracked entry for `Policy` and its subclasses; `info` hands out a frozen copy.

    Mutable, unlike the rest of the data: every hit updates it, and a frozen copy per hit would allocate.
    """

    inserted_at: float
    last_access: float
    deadline: float | None  # absolute: insert time plus the entry's ttl
    hits: int
    pinned: bool
    inserted_rank: int  # place among all inserts: ties in time still have an order
    used_rank: int  # place of its latest insert or touch, on the same counter
    retained_until: float | None = None  # absolute; None once the retention is over (see `Policy.retain`)


class Policy(ABC):
    """Track entries and decide which to evict next and which have expired; never touch storage.

    Every operation is O(1) or amortized O(log n); `expired` costs O(log n) plus the number of keys it finds.
    Not thread-safe: the store that owns a policy serializes calls to it.

    A retained entry (`retain`) is kept at least until its retention ends: it never expires before then, and it is
    chosen as a victim only when no unretained entry is left (then the one whose retention ends soonest), so the
    budget still holds. While retained it stands outside the victim and expiry orders; when its retention ends it
    goes back to the place its times give it.
    """

    name: ClassVar[str]
    # True where the name promises expiry, so a missing ttl fails at startup instead of never expiring.
    needs_expiry: ClassVar[bool] = False

    def __init__(
        self, *, clock: Clock = time.monotonic, ttl: float | None = None, idle_ttl: float | None = None
    ) -> None:
        self._clock = clock
        self._ttl = None if ttl is None else _seconds("ttl", ttl, "or None for no absolute expiry")
        self._idle_ttl = None if idle_ttl is None else _seconds("idle_ttl", idle_ttl, "or None for no idle expiry")
        if self.needs_expiry and self._ttl is None and self._idle_ttl is None:
            raise ConfigError(
                f"policy {self.name!r} needs an expiry: set ttl (seconds from insert) or idle_ttl "
                "(seconds since last access), or choose policy 'lru' to evict by recency alone"
            )
        self._entries: dict[Hashable, Entry] = {}
        # One counter ranks both inserts and uses, so "inserted or touched most recently" is a plain
        # comparison even when the clock returns the same time twice.
        self._ranks = count()
        # Expiry looks at every entry, pinned ones too. Absolute deadlines differ per entry (per-entry ttl),
        # so they sit in a heap. The idle lifetime is one value for all, so idle deadlines fall in last-access
        # order, and an OrderedDict moved-to-end on each use keeps them sorted at O(1) per hit, where a heap
        # would pay O(log n) and leave a stale item behind on every hit.
        self._deadlines = DeadlineOrder()
        self._idle_order: OrderedDict[Hashable, None] = OrderedDict()
        # Idle deadlines of entries whose retention ended and that were not used since: their last use is older than
        # that of entries at the end of `_idle_order`, so they wait in a heap until a use moves them there.
        self._released_idle = DeadlineOrder()
        # Retained entries by the end of their retention: all of them, to release them; the unpinned ones, as the
        # victims of last resort.
        self._retained = DeadlineOrder()
        self._retained_victims = DeadlineOrder()

    def insert(
        self, key: Hashable, *, ttl: float | None = None, pinned: bool = False, retain: float | None = None
    ) -> None:
        """Track `key` as just inserted, replacing any earlier entry; `ttl` overrides the policy's ttl.

        `retain` keeps it at least that many seconds (see `retain`).
        """
        lifetime = self._ttl if ttl is None else _seconds("ttl", ttl, "or None for the policy's default")
        if retain is not None:
            _seconds("retain", retain, "or None to keep the entry by the policy alone")
        if key in self._entries:
            self._forget(key)
        now = self._clock()
        rank = next(self._ranks)
        entry = Entry(
            inserted_at=now,
            last_access=now,
            deadline=None if lifetime is None else now + lifetime,
            hits=0,
            pinned=pinned,
            inserted_rank=rank,
            used_rank=rank,
        )
        self._entries[key] = entry
        self._track(key, entry)
        if retain is not None:
            self.retain(key, retain)

    def retain(self, key: Hashable, seconds: float) -> None:
        """Keep `key` at least `seconds` from now (never shortening a longer retention); unknown key: ignored.

        Until then it does not expire, and it is a victim only when every other unpinned entry is retained too.
        """
        _seconds("retain", seconds, "to keep the entry that long")
        entry = self._entries.get(key)
        if entry is None:
            return
        until = self._clock() + seconds
        if entry.retained_until is not None and entry.retained_until >= until:
            return
        if entry.retained_until is None:
            self._untrack(key, entry)
        entry.retained_until = until
        self._retained.add(key, until, entry.inserted_rank)
        if not entry.pinned:
            self._retained_victims.add(key, until, entry.inserted_rank)

    def touch(self, key: Hashable) -> None:
        """Record a hit on `key`; an unknown key is ignored."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.last_access = self._clock()
        entry.used_rank = next(self._ranks)
        entry.hits += 1
        if entry.retained_until is not None:
            return  # outside the orders until its retention ends; it comes back at the place this use gives it
        if self._idle_ttl is not None:
            self._released_idle.discard(key)
            self._idle_order[key] = None
            self._idle_order.move_to_end(key)
        if not entry.pinned:
            self._requeue(key, entry)

    def remove(self, key: Hashable) -> None:
        """Stop tracking `key`; an unknown key is ignored."""
        if key in self._entries:
            self._forget(key)

    def pin(self, key: Hashable) -> None:
        """Keep `key` from being chosen by `victim` until unpinned; it still expires. Unknown key: ignored."""
        entry = self._entries.get(key)
        if entry is not None and not entry.pinned:
            entry.pinned = True
            # Pinned keys leave the victim order, so victim() never wades through them.
            self._dequeue(key)
            self._retained_victims.discard(key)

    def unpin(self, key: Hashable) -> None:
        """Let `key` be chosen by `victim` again, in the place its times give it. Unknown key: ignored."""
        entry = self._entries.get(key)
        if entry is not None and entry.pinned:
            entry.pinned = False
            if entry.retained_until is None:
                self._enqueue(key, entry)
            else:
                self._retained_victims.add(key, entry.retained_until, entry.inserted_rank)

    def victim(self) -> Hashable | None:
        """Return the unpinned key to evict next, without removing it; None when there is none.

        The policy's own choice among unretained entries; when every unpinned entry is retained, the one whose
        retention ends soonest.
        """
        self._release_due()
        chosen = self._victim()
        return chosen if chosen is not None else self._retained_victims.first()

    def expired(self) -> list[Hashable]:
        """Return the keys whose absolute or idle deadline is <= now, soonest deadline first; remove none.

        A retained key is never among them before its retention ends.
        """
        self._release_due()
        now = self._clock()
        due = set(self._deadlines.due(now)) | set(self._released_idle.due(now))
        if self._idle_ttl is not None:
            for key in self._idle_order:  # least recently used first: stop at the first one still alive
                if self._entries[key].last_access + self._idle_ttl > now:
                    break
                due.add(key)
        return sorted(due, key=self._expiry_order)

    def info(self, key: Hashable) -> EntryTimes | None:
        """Return the times and hit count of `key`, or None when it is not tracked."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return EntryTimes(
            inserted_at=entry.inserted_at,
            last_access=entry.last_access,
            expires_at=self._expires_at(entry),
            hits=entry.hits,
            pinned=entry.pinned,
            retained_until=entry.retained_until,
        )

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(entries={len(self)}, ttl={self._ttl}, idle_ttl={self._idle_ttl})"

    # Hooks: a subclass keeps its own victim order over the unpinned, unretained entries only.

    @abstractmethod
    def _victim(self) -> Hashable | None:
        """Return the key first in the victim order, without removing it; None when the order is empty."""

    @abstractmethod
    def _enqueue(self, key: Hashable, entry: Entry) -> None:
        """Add an unpinned entry to the victim order (after insert or unpin)."""

    @abstractmethod
    def _dequeue(self, key: Hashable) -> None:
        """Drop a key from the victim order (on remove, re-insert or pin)."""

    @abstractmethod
    def _requeue(self, key: Hashable, entry: Entry) -> None:
        """Update the victim order after a hit on an unpinned entry."""

    def _expires_at(self, entry: Entry) -> float | None:
        idle = None if self._idle_ttl is None else entry.last_access + self._idle_ttl
        if entry.deadline is None or idle is None:
            expires = idle if entry.deadline is None else entry.deadline
        else:
            expires = min(entry.deadline, idle)
        if expires is None or entry.retained_until is None:
            return expires
        return max(expires, entry.retained_until)

    def _expiry_order(self, key: Hashable) -> tuple[float, int]:
        entry = self._entries[key]
        expires_at = self._expires_at(entry)
        assert expires_at is not None, "only entries with a deadline can expire"
        return expires_at, entry.inserted_rank

    def _track(self, key: Hashable, entry: Entry, *, released: bool = False) -> None:
        """Put an unretained entry in the expiry orders, and in the victim order unless pinned (the orders place a
        returning key by its old rank).

        A `released` entry, whose retention just ended, waits for its idle deadline in a heap, not at the end of
        `_idle_order`: entries used after it sit there, and `expired` stops at the first one still alive.
        """
        if entry.deadline is not None:
            self._deadlines.add(key, entry.deadline, entry.inserted_rank)
        if self._idle_ttl is not None and released:
            self._released_idle.add(key, entry.last_access + self._idle_ttl, entry.used_rank)
        elif self._idle_ttl is not None:
            self._idle_order[key] = None
        if not entry.pinned:
            self._enqueue(key, entry)

    def _untrack(self, key: Hashable, entry: Entry) -> None:
        self._deadlines.discard(key)
        self._idle_order.pop(key, None)
        self._released_idle.discard(key)
        if not entry.pinned:
            self._dequeue(key)

    def _release_due(self) -> None:
        """Put entries whose retention has ended back in the orders, at the places their times give them."""
        now = self._clock()
        for key in self._retained.due(now):
            entry = self._entries[key]
            entry.retained_until = None
            self._retained.discard(key)
            self._retained_victims.discard(key)
            self._track(key, entry, released=True)

    def _forget(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._retained.discard(key)
        self._retained_victims.discard(key)
        self._untrack(key, entry)


def _seconds(name: str, value: object, none_means: str) -> float:
    # Typed `object` because settings files hand over strings and bools too; bool is an int, but `ttl=True`
    # is a mistake, not one second.
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ConfigError(
        f"{name} must be a positive, finite number of seconds, got {value!r}; "
        f"set {name} to a number above 0, {none_means}"
    )
