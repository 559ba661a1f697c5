"""Eviction and expiry policies: decide which key goes next and which have expired, never touching storage.

Exports the contract (`Policy`, its `Clock` and the `EntryTimes` it reports), the concrete policies
(`LRUPolicy` "lru", `LRUTTLPolicy` "lru+ttl", `TTLPolicy` "ttl", `FIFOPolicy` "fifo"), and the registry that
builds them by name (`POLICIES`, `make_policy`, `policy_names`, and `PolicyOptions`, the options all take).
"""

from prefixgate.policies.lru import FIFOPolicy, LRUPolicy, LRUTTLPolicy
from prefixgate.policies.policy import Clock, EntryTimes, Policy
from prefixgate.policies.registry import POLICIES, PolicyOptions, make_policy, policy_names
from prefixgate.policies.ttl import TTLPolicy

__all__ = [
    "POLICIES",
    "Clock",
    "EntryTimes",
    "FIFOPolicy",
    "LRUPolicy",
    "LRUTTLPolicy",
    "Policy",
    "PolicyOptions",
    "TTLPolicy",
    "make_policy",
    "policy_names",
]
