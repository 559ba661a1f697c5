"""Every policy against a naive model over long random runs: the lazy heaps must answer what a full scan would.

The model keeps plain records and scans all of them on each question, which is obviously right and too slow for
a store; the policies must agree with it after every operation, including runs long enough to rebuild heaps.
"""

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest

from prefixgate.policies import POLICIES, make_policy, policy_names


@dataclass(slots=True)
class Record:
    """One entry as the model sees it."""

    inserted_at: float
    last_access: float
    deadline: float | None
    pinned: bool
    inserted_rank: int
    used_rank: int
    retained_until: float | None = None


class NaiveModel:
    """Track entries in a dict, keep the time, and answer every question by scanning all entries."""

    def __init__(self, ttl: float | None, idle_ttl: float | None) -> None:
        self.now = 0.0
        self.ttl = ttl
        self.idle_ttl = idle_ttl
        self.records: dict[Hashable, Record] = {}
        self.rank = 0

    def clock(self) -> float:
        return self.now

    def insert(self, key: Hashable, ttl: float | None, pinned: bool, retain: float | None) -> None:
        lifetime = ttl if ttl is not None else self.ttl
        deadline = None if lifetime is None else self.now + lifetime
        self.rank += 1
        until = None if retain is None else self.now + retain
        self.records[key] = Record(self.now, self.now, deadline, pinned, self.rank, self.rank, until)

    def retain(self, key: Hashable, seconds: float) -> None:
        record = self.records.get(key)
        if record is not None:
            record.retained_until = max(record.retained_until or 0.0, self.now + seconds)

    def retained(self, record: Record) -> bool:
        return record.retained_until is not None and record.retained_until > self.now

    def touch(self, key: Hashable) -> None:
        if key in self.records:
            self.rank += 1
            self.records[key].last_access = self.now
            self.records[key].used_rank = self.rank

    def expires_at(self, record: Record) -> float:
        idle = None if self.idle_ttl is None else record.last_access + self.idle_ttl
        deadlines = [d for d in (record.deadline, idle) if d is not None]
        return min(deadlines, default=float("inf"))

    def expired(self) -> list[Hashable]:
        due = [
            key
            for key, record in self.records.items()
            if not self.retained(record) and self.expires_at(record) <= self.now
        ]
        return sorted(due, key=lambda key: (self.expires_at(self.records[key]), self.records[key].inserted_rank))

    def victim(self, policy_name: str) -> Hashable | None:
        unpinned = {key: record for key, record in self.records.items() if not record.pinned}
        free = {key: record for key, record in unpinned.items() if not self.retained(record)}
        if free:
            return min(free, key=lambda key: self._victim_rank(policy_name, free[key]))
        # Every unpinned entry is retained: the one whose retention ends soonest.
        return min(unpinned, key=lambda key: (unpinned[key].retained_until, unpinned[key].inserted_rank), default=None)

    def _victim_rank(self, policy_name: str, record: Record) -> tuple[float, int]:
        # A new policy needs its rule here too; the KeyError says so.
        rules: dict[str, Callable[[Record], tuple[float, int]]] = {
            "lru": lambda r: (r.used_rank, 0),
            "lru+ttl": lambda r: (r.used_rank, 0),
            "fifo": lambda r: (r.inserted_rank, 0),
            "ttl": lambda r: (self.expires_at(r), r.inserted_rank),
        }
        return rules[policy_name](record)


EXPIRY_SETTINGS = {"none": (None, None), "ttl": (20.0, None), "idle": (None, 8.0), "both": (20.0, 8.0)}
RUNS = [
    pytest.param(name, ttl, idle_ttl, id=f"{name}-{setting}")
    for name in policy_names()
    for setting, (ttl, idle_ttl) in EXPIRY_SETTINGS.items()
    if ttl is not None or idle_ttl is not None or not POLICIES[name].needs_expiry
]


@pytest.mark.parametrize(("name", "ttl", "idle_ttl"), RUNS)
@pytest.mark.parametrize("seed", [1, 2])
def test_policy_agrees_with_naive_model_over_random_operations(
    name: str, ttl: float | None, idle_ttl: float | None, seed: int
) -> None:
    rng = random.Random(seed)
    model = NaiveModel(ttl, idle_ttl)
    policy = make_policy(name, clock=model.clock, ttl=ttl, idle_ttl=idle_ttl)
    keys = range(60)
    for step in range(3000):
        # Time moves a random positive amount before each operation, so no two events tie by accident.
        model.now += rng.uniform(0.001, 0.4)
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.3:
            entry_ttl = rng.choice([None, None, 3.0, 11.5, 40.0])
            pinned = rng.random() < 0.15
            retain = rng.choice([None, None, None, 2.5, 14.0])
            policy.insert(key, ttl=entry_ttl, pinned=pinned, retain=retain)
            model.insert(key, entry_ttl, pinned, retain)
        elif op < 0.36:
            seconds = rng.choice([1.5, 6.0, 30.0])
            policy.retain(key, seconds)
            model.retain(key, seconds)
        elif op < 0.55:
            policy.touch(key)
            model.touch(key)
        elif op < 0.65:
            policy.pin(key)
            if key in model.records:
                model.records[key].pinned = True
        elif op < 0.8:
            policy.unpin(key)
            if key in model.records:
                model.records[key].pinned = False
        elif op < 0.9:
            victim = policy.victim()
            if victim is not None:
                policy.remove(victim)
                del model.records[victim]
        else:
            for expired_key in policy.expired():
                policy.remove(expired_key)
                del model.records[expired_key]
        assert policy.victim() == model.victim(name), f"victim differs at step {step}"
        assert policy.expired() == model.expired(), f"expired differs at step {step}"
        assert len(policy) == len(model.records)
        info = policy.info(key)
        if info is not None and model.retained(model.records[key]):
            assert info.retained_until == model.records[key].retained_until
