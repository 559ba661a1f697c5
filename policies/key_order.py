"""Ordered sets of keys that the policies build their victim and expiry orders from.

Both orders delete lazily: dropping a key forgets it in a dict at O(1) and leaves its heap item behind, stale.
Stale items are skipped when they reach the top of the heap, and the heap is rebuilt once they outnumber the
live ones, so every operation stays amortized O(log n) and no query scans all keys.
"""

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from itertools import count

# Rebuild a heap once its stale items outnumber the live ones by this much; below it a rebuild costs more.
_COMPACT_SLACK = 32


class RankOrder:
    """Keep keys ordered by a unique integer rank; cheapest when each added key has the highest rank so far.

    Ranks come from one increasing counter (insert or use order), so nearly every add carries a rank above all
    present ones and lands at the end of an OrderedDict in O(1). The exception is a key coming back with an
    old rank (an unpinned entry keeps its place in recency order); such keys wait in a small heap, and `first`
    takes the lower of the two fronts. Appending a returning key as if new was rejected: an unpin is not a
    use, and LRU would then keep a long-unused entry over recently used ones.
    """

    __slots__ = ("_back", "_back_stamp", "_stamps", "_tail")

    def __init__(self) -> None:
        # Keys whose ranks increase along the dict's order; the whole order while no key returns.
        self._tail: OrderedDict[Hashable, int] = OrderedDict()
        # Returning keys: heap items are (rank, stamp, key), live while the stamp is the key's latest.
        self._back: list[tuple[int, int, Hashable]] = []
        self._back_stamp: dict[Hashable, int] = {}
        self._stamps = count()

    def add(self, key: Hashable, rank: int) -> None:
        """Place `key` at `rank`, moving it if it is already present."""
        self.discard(key)
        if not self._tail or rank > next(reversed(self._tail.values())):
            self._tail[key] = rank
            return
        stamp = next(self._stamps)
        self._back_stamp[key] = stamp
        heapq.heappush(self._back, (rank, stamp, key))
        self._compact()

    def discard(self, key: Hashable) -> None:
        """Drop `key` if present."""
        if self._tail.pop(key, None) is None and self._back_stamp.pop(key, None) is not None:
            self._compact()

    def first(self) -> Hashable | None:
        """Return the key of lowest rank, or None when empty."""
        back = self._back
        while back and self._back_stamp.get(back[0][2]) != back[0][1]:
            heapq.heappop(back)
        tail_first = next(iter(self._tail.items()), None)
        if not back:
            return None if tail_first is None else tail_first[0]
        if tail_first is None or back[0][0] < tail_first[1]:
            return back[0][2]
        return tail_first[0]

    def __len__(self) -> int:
        return len(self._tail) + len(self._back_stamp)

    def _compact(self) -> None:
        if len(self._back) > 2 * len(self._back_stamp) + _COMPACT_SLACK:
            self._back = [item for item in self._back if self._back_stamp.get(item[2]) == item[1]]
            heapq.heapify(self._back)


class DeadlineOrder:
    """Keep keys ordered by deadline (ties by rank) in a heap; list the due ones without scanning the rest."""

    __slots__ = ("_heap", "_stamps", "_stamps_of")

    def __init__(self) -> None:
        # Items are (deadline, rank, stamp, key); the unique stamp keeps keys, which need not be orderable,
        # out of comparisons and tells a live item from a stale one.
        self._heap: list[tuple[float, int, int, Hashable]] = []
        self._stamps_of: dict[Hashable, int] = {}
        self._stamps = count()

    def add(self, key: Hashable, deadline: float, rank: int) -> None:
        """Place `key` at `deadline`, moving it if it is already present; `rank` orders equal deadlines."""
        stamp = next(self._stamps)
        self._stamps_of[key] = stamp
        heapq.heappush(self._heap, (deadline, rank, stamp, key))
        self._compact()

    def discard(self, key: Hashable) -> None:
        """Drop `key` if present."""
        if self._stamps_of.pop(key, None) is not None:
            self._compact()

    def first(self) -> Hashable | None:
        """Return the key with the soonest deadline, or None when empty."""
        self._drop_stale_top()
        return self._heap[0][3] if self._heap else None

    def due(self, now: float) -> list[Hashable]:
        """Return the keys whose deadline is <= `now`, in no particular order."""
        self._drop_stale_top()
        heap, found = self._heap, []
        # The items <= now form a subtree hanging from the root (a parent is never later than its children),
        # so walking only that subtree costs O(due) where popping and re-pushing would cost O(due log n).
        stack = [0]
        while stack:
            i = stack.pop()
            if i >= len(heap) or heap[i][0] > now:
                continue
            _, _, stamp, key = heap[i]
            if self._stamps_of.get(key) == stamp:
                found.append(key)
            stack += (2 * i + 1, 2 * i + 2)
        return found

    def __len__(self) -> int:
        return len(self._stamps_of)

    def _drop_stale_top(self) -> None:
        heap = self._heap
        while heap and self._stamps_of.get(heap[0][3]) != heap[0][2]:
            heapq.heappop(heap)

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._stamps_of) + _COMPACT_SLACK:
            self._heap = [item for item in self._heap if self._stamps_of.get(item[3]) == item[2]]
            heapq.heapify(self._heap)
