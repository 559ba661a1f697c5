"""Each policy's own victim order, asserted key by key, and the settings each one requires."""

import pytest

from prefixgate.errors import ConfigError
from prefixgate.policies import FIFOPolicy, LRUPolicy, LRUTTLPolicy, TTLPolicy
from tests.policies.test_policy_contract import FakeClock, drain


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_lru_evicts_least_recently_used_first(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock)
    for key in "abcd":
        policy.insert(key)
    policy.touch("b")
    policy.touch("a")
    assert drain(policy) == ["c", "d", "b", "a"]


def test_lru_orders_by_use_even_when_the_clock_stands_still(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock)
    for key in "abc":
        policy.insert(key)
    policy.touch("a")
    policy.touch("b")
    assert drain(policy) == ["c", "a", "b"]


def test_lru_unpinned_key_returns_to_its_recency_place(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock)
    for key in "abcde":
        policy.insert(key)
    policy.pin("b")
    policy.pin("d")
    policy.touch("a")  # a is now the most recently used
    policy.unpin("d")  # unpinning is not a use: d goes back before a, not after it
    policy.unpin("b")
    assert drain(policy) == ["b", "c", "d", "e", "a"]


def test_lru_touch_of_pinned_key_counts_once_unpinned(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock)
    for key in "abc":
        policy.insert(key, pinned=key == "a")
    policy.touch("a")
    policy.unpin("a")
    assert drain(policy) == ["b", "c", "a"]


def test_lru_without_ttl_never_expires(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock)
    policy.insert("a")
    clock.advance(1e9)
    assert policy.expired() == []
    info = policy.info("a")
    assert info is not None and info.expires_at is None


def test_lru_with_ttl_expires_but_evicts_by_recency(clock: FakeClock) -> None:
    policy = LRUPolicy(clock=clock, ttl=100)
    policy.insert("a")
    policy.insert("b", ttl=5)
    policy.insert("c", ttl=50)
    clock.advance(5)
    assert policy.expired() == ["b"]
    assert drain(policy) == ["a", "b", "c"]


def test_lru_ttl_evicts_by_recency_not_deadline(clock: FakeClock) -> None:
    policy = LRUTTLPolicy(clock=clock, ttl=100, idle_ttl=30)
    policy.insert("a", ttl=200)
    policy.insert("b", ttl=10)
    policy.insert("c")
    policy.touch("a")
    assert drain(policy) == ["b", "c", "a"]


def test_fifo_evicts_in_insertion_order_whatever_the_hits(clock: FakeClock) -> None:
    policy = FIFOPolicy(clock=clock)
    for key in "abcd":
        policy.insert(key)
    policy.touch("a")
    policy.touch("c")
    policy.pin("b")
    policy.unpin("b")
    assert drain(policy) == ["a", "b", "c", "d"]


def test_ttl_evicts_soonest_deadline_first(clock: FakeClock) -> None:
    policy = TTLPolicy(clock=clock, ttl=100)
    policy.insert("a", ttl=30)
    policy.insert("b")
    policy.insert("c", ttl=10)
    policy.insert("d", ttl=30)
    policy.touch("b")  # an absolute deadline does not move on a hit
    assert drain(policy) == ["c", "a", "d", "b"]


def test_ttl_with_idle_ttl_evicts_least_recently_used_first(clock: FakeClock) -> None:
    policy = TTLPolicy(clock=clock, idle_ttl=10)
    for key in "abc":
        policy.insert(key)
    clock.advance(1)
    policy.touch("a")
    assert drain(policy) == ["b", "c", "a"]


def test_ttl_evicts_by_the_sooner_of_absolute_and_idle_deadline(clock: FakeClock) -> None:
    policy = TTLPolicy(clock=clock, ttl=100, idle_ttl=10)
    policy.insert("a", ttl=5)  # absolute 1005 beats idle 1010
    policy.insert("b")  # idle 1010, 1013 after the touch
    policy.insert("c")  # idle 1010
    policy.insert("d", ttl=12)  # idle 1010, 1013 after the touch, when absolute 1012 comes first
    clock.advance(3)
    policy.touch("b")
    policy.touch("d")
    assert drain(policy) == ["a", "c", "d", "b"]


def test_ttl_unpinned_key_returns_to_its_deadline_place(clock: FakeClock) -> None:
    policy = TTLPolicy(clock=clock, ttl=100)
    policy.insert("a", ttl=10)
    policy.insert("b", ttl=20)
    policy.insert("c", ttl=30)
    policy.pin("a")
    assert policy.victim() == "b"
    policy.unpin("a")
    assert drain(policy) == ["a", "b", "c"]


def test_ttl_unpinned_key_keeps_its_idle_deadline(clock: FakeClock) -> None:
    policy = TTLPolicy(clock=clock, idle_ttl=10)
    for key in "abc":
        policy.insert(key)
    policy.pin("a")
    clock.advance(1)
    policy.touch("b")
    policy.unpin("a")
    assert drain(policy) == ["a", "c", "b"]


@pytest.mark.parametrize("policy_class", [TTLPolicy, LRUTTLPolicy])
def test_expiring_policy_requires_ttl_or_idle_ttl(policy_class: type[TTLPolicy | LRUTTLPolicy]) -> None:
    with pytest.raises(ConfigError, match=r"needs an expiry: set ttl .* or idle_ttl") as caught:
        policy_class()
    assert repr(policy_class.name) in str(caught.value)
    assert policy_class(idle_ttl=1).victim() is None
    assert policy_class(ttl=1).victim() is None
