"""The registry of policies by name: how settings and the CLI turn a policy name into a policy."""

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypedDict, Unpack

from prefixgate.errors import ConfigError, UnknownPolicyError
from prefixgate.policies.lru import FIFOPolicy, LRUPolicy, LRUTTLPolicy
from prefixgate.policies.policy import Clock, Policy
from prefixgate.policies.ttl import TTLPolicy


class PolicyOptions(TypedDict, total=False):
    """Name the keyword options every policy takes."""

    clock: Clock
    ttl: float | None
    idle_ttl: float | None


# A fixed table rather than a registering decorator: no import order can leave a policy out, and adding one is
# a visible one-line change here.
POLICIES: Mapping[str, type[Policy]] = MappingProxyType(
    {cls.name: cls for cls in (LRUPolicy, LRUTTLPolicy, TTLPolicy, FIFOPolicy)}
)


def policy_names() -> list[str]:
    """Return the registered policy names, sorted."""
    return sorted(POLICIES)


def make_policy(name: str, **options: Unpack[PolicyOptions]) -> Policy:
    """Build the policy registered as `name` with `options`; raise UnknownPolicyError for an unknown name."""
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicyError(f"unknown policy {name!r}; choose one of: {', '.join(policy_names())}")
    # Options often come from a settings file, where a typo should list what is accepted, not raise TypeError.
    unknown = sorted(set(options) - set(PolicyOptions.__annotations__))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for policy {name!r}; "
            f"accepted: {', '.join(PolicyOptions.__annotations__)}"
        )
    return cls(**options)
