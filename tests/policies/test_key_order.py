"""The key orders under the policies: right answers, keys that cannot be compared, and heaps that stay small."""

import random
from collections import Counter

from prefixgate.policies.key_order import DeadlineOrder, RankOrder


def drain_ranks(order: RankOrder) -> list[object]:
    """Take keys off the front until the order is empty, and return them in order."""
    keys = []
    while (key := order.first()) is not None:
        keys.append(key)
        order.discard(key)
    return keys


def test_rank_order_puts_a_key_returning_with_an_old_rank_back_in_its_place() -> None:
    order = RankOrder()
    for rank, key in enumerate("abcd"):
        order.add(key, rank)
    order.discard("b")
    order.add("e", 9)
    order.add("b", 1)
    assert len(order) == 5
    assert drain_ranks(order) == ["a", "b", "c", "d", "e"]


def test_rank_order_add_moves_a_present_key() -> None:
    order = RankOrder()
    for rank, key in enumerate("abc"):
        order.add(key, rank)
    order.add("a", 5)
    order.add("c", 0)  # back to the front from the tail
    assert len(order) == 3
    assert drain_ranks(order) == ["c", "b", "a"]


def test_rank_order_ignores_discard_of_an_absent_key() -> None:
    order = RankOrder()
    order.discard("ghost")
    order.add("a", 0)
    order.discard("ghost")
    assert drain_ranks(order) == ["a"]
    assert order.first() is None


def test_rank_order_heap_stays_bounded_under_pin_unpin_churn() -> None:
    order = RankOrder()
    for rank in range(100):
        order.add(rank, rank)
    for _ in range(50):  # every key leaves and comes back with its old rank, as pin and unpin do
        for rank in range(0, 100, 2):
            order.discard(rank)
            order.add(rank, rank)
    assert len(order._back) <= 2 * len(order) + 32
    assert drain_ranks(order) == list(range(100))


def test_deadline_order_gives_soonest_first_with_ties_by_rank() -> None:
    order = DeadlineOrder()
    order.add("late", 30.0, rank=0)
    order.add("second", 10.0, rank=2)
    order.add("first", 10.0, rank=1)
    assert order.first() == "first"
    order.discard("first")
    assert order.first() == "second"
    order.add("second", 40.0, rank=2)  # moved: its old place no longer counts
    assert order.first() == "late"
    assert len(order) == 2


def test_deadline_order_never_compares_keys() -> None:
    order = DeadlineOrder()
    first, second = object(), object()
    order.add(first, 5.0, rank=0)
    order.add(second, 5.0, rank=0)
    assert order.first() is first
    assert set(order.due(5.0)) == {first, second}


def test_deadline_order_due_lists_exactly_the_live_keys_at_or_before_now() -> None:
    rng = random.Random(7)
    order = DeadlineOrder()
    deadlines: dict[int, float] = {}
    for step in range(2000):
        key = rng.randrange(200)
        if rng.random() < 0.3:
            order.discard(key)
            deadlines.pop(key, None)
        else:
            deadlines[key] = rng.uniform(0, 100)
            order.add(key, deadlines[key], rank=step)
        now = rng.uniform(0, 100)
        assert Counter(order.due(now)) == Counter(k for k, d in deadlines.items() if d <= now)
    assert len(order) == len(deadlines)


def test_deadline_order_heap_is_rebuilt_when_stale_items_dominate() -> None:
    order = DeadlineOrder()
    for key in range(1000):
        order.add(key, float(key), rank=key)
    for key in range(999, 99, -1):  # from the back, so no stale item ever reaches the top to be popped
        order.discard(key)
    assert len(order) == 100
    assert len(order._heap) <= 2 * 100 + 32
    assert Counter(order.due(1e9)) == Counter(range(100))
