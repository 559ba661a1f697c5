"""The contract every registered policy passes, driven by a fake clock; each policy's own order is tested apart."""

import dataclasses
import math
from collections.abc import Hashable
from typing import Protocol

import pytest

from prefixgate.errors import ConfigError
from prefixgate.policies import POLICIES, EntryTimes, Policy, make_policy, policy_names
from tests.fake_clock import FakeClock

HOUR = 3600.0


class MakePolicy(Protocol):
    """Build the policy under test on the test's clock."""

    def __call__(self, *, ttl: float | None = HOUR, idle_ttl: float | None = None) -> Policy: ...


def drain(policy: Policy) -> list[Hashable]:
    """Evict until no victim is left, as a store would, and return the keys in eviction order."""
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
        policy.remove(key)
    return order


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture(params=policy_names())
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make(name: str, clock: FakeClock) -> MakePolicy:
    # A default ttl of an hour lets the policies that need an expiry run every test that is not about expiry.
    def build(*, ttl: float | None = HOUR, idle_ttl: float | None = None) -> Policy:
        return make_policy(name, clock=clock, ttl=ttl, idle_ttl=idle_ttl)

    return build


def test_policy_reports_its_registered_name(name: str, make: MakePolicy) -> None:
    policy = make()
    assert policy.name == name
    assert type(policy) is POLICIES[name]


def test_new_policy_is_empty(make: MakePolicy) -> None:
    policy = make()
    assert len(policy) == 0
    assert "a" not in policy
    assert policy.victim() is None
    assert policy.expired() == []


def test_remove_forgets_key_and_ignores_unknown(make: MakePolicy) -> None:
    policy = make()
    policy.insert("a")
    policy.insert("b")
    policy.remove("a")
    policy.remove("never-inserted")
    assert "a" not in policy
    assert "b" in policy
    assert len(policy) == 1
    assert policy.info("a") is None
    assert drain(policy) == ["b"]


def test_unknown_key_is_ignored_by_touch_pin_and_unpin(make: MakePolicy) -> None:
    policy = make()
    policy.touch("ghost")
    policy.pin("ghost")
    policy.unpin("ghost")
    assert len(policy) == 0
    assert "ghost" not in policy


def test_victim_does_not_remove_the_key(make: MakePolicy) -> None:
    policy = make()
    policy.insert("a")
    policy.insert("b")
    first = policy.victim()
    assert policy.victim() == first
    assert first in policy
    assert len(policy) == 2


def test_draining_victims_yields_each_unpinned_key_once(make: MakePolicy) -> None:
    policy = make()
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        policy.insert(key)
    policy.touch("k3")
    policy.touch("k0")
    assert sorted(drain(policy), key=str) == keys
    assert len(policy) == 0


def test_pinned_key_is_never_victim_until_unpinned(make: MakePolicy) -> None:
    policy = make()
    policy.insert("a", pinned=True)
    policy.insert("b")
    policy.insert("c")
    policy.pin("b")
    assert drain(policy) == ["c"]
    assert policy.victim() is None
    assert len(policy) == 2
    policy.unpin("a")
    assert drain(policy) == ["a"]
    policy.unpin("b")
    assert drain(policy) == ["b"]


def test_victim_is_none_when_everything_is_pinned(make: MakePolicy) -> None:
    policy = make()
    for key in "abc":
        policy.insert(key, pinned=True)
    assert policy.victim() is None
    assert policy.info("a") == EntryTimes(1000.0, 1000.0, 1000.0 + HOUR, hits=0, pinned=True)


def test_pinned_entry_still_expires(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10)
    policy.insert("a", pinned=True)
    clock.advance(10)
    assert policy.expired() == ["a"]
    assert policy.victim() is None


def test_idle_ttl_restarts_on_touch(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=None, idle_ttl=10)
    policy.insert("a")
    policy.insert("b")
    clock.advance(6)
    policy.touch("a")
    clock.advance(4)
    assert policy.expired() == ["b"]
    clock.advance(6)
    assert policy.expired() == ["b", "a"]
    info = policy.info("a")
    assert info is not None and info.expires_at == 1016.0


def test_absolute_ttl_does_not_restart_on_touch(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10)
    policy.insert("a")
    clock.advance(9)
    policy.touch("a")
    info = policy.info("a")
    assert info is not None and info.expires_at == 1010.0
    clock.advance(1)
    assert policy.expired() == ["a"]


def test_entry_expires_at_the_sooner_of_absolute_and_idle_deadline(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10, idle_ttl=4)
    policy.insert("a")
    expiries = []
    for _ in range(3):
        clock.advance(3)
        policy.touch("a")
        info = policy.info("a")
        assert info is not None
        expiries.append(info.expires_at)
    assert expiries == [1007.0, 1010.0, 1010.0]  # idle until the absolute deadline comes first


def test_per_entry_ttl_overrides_the_default(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=100)
    policy.insert("short", ttl=5)
    policy.insert("long", ttl=500)
    policy.insert("default")
    clock.advance(100)
    assert policy.expired() == ["short", "default"]
    clock.advance(400)
    assert policy.expired() == ["short", "default", "long"]


def test_per_entry_ttl_applies_without_a_default_ttl(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=None, idle_ttl=50)
    policy.insert("a", ttl=5)
    clock.advance(5)
    assert policy.expired() == ["a"]


def test_reinsert_resets_times_hits_and_deadline(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10)
    policy.insert("a", pinned=True)
    policy.touch("a")
    clock.advance(8)
    policy.insert("a")
    assert policy.info("a") == EntryTimes(1008.0, 1008.0, 1018.0, hits=0, pinned=False)
    clock.advance(5)
    assert policy.expired() == []
    assert len(policy) == 1


def test_reinsert_moves_key_behind_the_others_like_a_fresh_insert(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10)
    for key in "abc":
        policy.insert(key)
    clock.advance(1)
    policy.insert("a")
    assert drain(policy) == ["b", "c", "a"]


def test_expired_lists_keys_in_deadline_order_and_removes_none(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=100)
    policy.insert("a", ttl=30)
    policy.insert("b", ttl=10)
    policy.insert("c", ttl=20)
    policy.insert("d")
    policy.insert("e", ttl=20)
    clock.advance(30)
    assert policy.expired() == ["b", "c", "e", "a"]  # equal deadlines keep insertion order
    assert policy.expired() == ["b", "c", "e", "a"]
    assert len(policy) == 5
    policy.remove("c")
    assert policy.expired() == ["b", "e", "a"]


def test_expired_includes_a_deadline_equal_to_now(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10)
    policy.insert("a")
    clock.advance(9)
    assert policy.expired() == []
    clock.advance(1)
    assert policy.expired() == ["a"]


def test_info_reports_times_and_counts_hits(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=60)
    policy.insert("a")
    clock.advance(2)
    policy.touch("a")
    clock.advance(3)
    policy.touch("a")
    assert policy.info("a") == EntryTimes(1000.0, 1005.0, 1060.0, hits=2, pinned=False)
    info = policy.info("a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.hits = 0  # type: ignore[misc, union-attr]


BAD_SECONDS: list[object] = [0, -1, -0.5, math.inf, -math.inf, math.nan, "10", True]


@pytest.mark.parametrize("option", ["ttl", "idle_ttl"])
@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_bad_ttl_option_raises_config_error_saying_what_to_set(name: str, option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{option} must be a positive, finite number of seconds") as caught:
        make_policy(name, **{option: value})  # type: ignore[arg-type]
    assert f"set {option} to a number above 0" in str(caught.value)


@pytest.mark.parametrize("option", ["ttl", "retain"])
@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_bad_per_entry_ttl_or_retention_raises_config_error_and_inserts_nothing(
    make: MakePolicy, option: str, value: object
) -> None:
    policy = make()
    with pytest.raises(ConfigError, match=f"{option} must be a positive, finite number of seconds"):
        policy.insert("a", **{option: value})  # type: ignore[arg-type]
    assert "a" not in policy


def test_retained_entries_go_when_nothing_unretained_is_left_soonest_retention_end_first(make: MakePolicy) -> None:
    policy = make()
    policy.insert("long", retain=3600)
    policy.insert("short", retain=300)
    policy.insert("b")
    policy.insert("pinned", pinned=True)
    assert drain(policy) == ["b", "short", "long"]  # within the budget: a retained entry goes when nothing else can


def test_retained_entry_outlives_its_ttl_and_expires_once_retention_ends(make: MakePolicy, clock: FakeClock) -> None:
    policy = make(ttl=10, idle_ttl=5)
    policy.insert("a", retain=60)
    clock.advance(59)
    assert policy.expired() == []
    assert policy.info("a") == EntryTimes(1000.0, 1000.0, 1060.0, hits=0, pinned=False, retained_until=1060.0)
    clock.advance(1)
    assert policy.expired() == ["a"]
    assert policy.info("a") == EntryTimes(1000.0, 1000.0, 1005.0, hits=0, pinned=False)


def test_entry_returns_to_its_place_by_use_when_retention_ends(make: MakePolicy, clock: FakeClock) -> None:
    policy = make()
    policy.insert("a", retain=10)
    clock.advance(1)
    policy.insert("b")
    policy.insert("c")
    assert policy.victim() == "b"
    clock.advance(10)
    # Retention over: "a" is the oldest insert, used least recently, and (ttl) the first to expire.
    assert drain(policy) == ["a", "b", "c"]


def test_retain_extends_but_never_shortens_a_retention(make: MakePolicy, clock: FakeClock) -> None:
    policy = make()
    policy.insert("a", retain=100)
    policy.retain("a", 10)
    policy.retain("ghost", 10)  # unknown: ignored
    info = policy.info("a")
    assert info is not None and info.retained_until == 1100.0
    policy.retain("a", 500)
    info = policy.info("a")
    assert info is not None and info.retained_until == 1500.0


def test_pinned_retained_entry_is_never_a_victim(make: MakePolicy, clock: FakeClock) -> None:
    policy = make()
    policy.insert("a", retain=100, pinned=True)
    assert policy.victim() is None
    policy.unpin("a")
    assert policy.victim() == "a"
    clock.advance(100)
    policy.pin("a")
    assert policy.victim() is None
