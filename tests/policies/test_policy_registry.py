"""The registry: names, building by name, and the errors a bad name or option gives."""

import pytest

import prefixgate.policies
from prefixgate.errors import ConfigError, UnknownPolicyError
from prefixgate.policies import (
    POLICIES,
    FIFOPolicy,
    LRUPolicy,
    LRUTTLPolicy,
    TTLPolicy,
    make_policy,
    policy_names,
)


def test_policy_names_lists_every_registered_policy_sorted() -> None:
    assert policy_names() == ["fifo", "lru", "lru+ttl", "ttl"]
    assert {"fifo": FIFOPolicy, "lru": LRUPolicy, "lru+ttl": LRUTTLPolicy, "ttl": TTLPolicy} == POLICIES


@pytest.mark.parametrize("name", policy_names())
def test_make_policy_builds_the_registered_class_with_its_options(name: str) -> None:
    policy = make_policy(name, clock=lambda: 5.0, ttl=2)
    assert type(policy) is POLICIES[name]
    policy.insert("a")
    info = policy.info("a")
    assert info is not None and info.inserted_at == 5.0 and info.expires_at == 7.0


def test_unknown_policy_name_error_lists_the_valid_names() -> None:
    with pytest.raises(UnknownPolicyError) as caught:
        make_policy("lfu")
    assert str(caught.value) == "unknown policy 'lfu'; choose one of: fifo, lru, lru+ttl, ttl"
    # Callers that only know the builtins or the config root still catch it.
    assert isinstance(caught.value, KeyError)
    assert isinstance(caught.value, ConfigError)


def test_unknown_option_raises_config_error_listing_accepted_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        make_policy("lru", ttl=5, max_size=10)  # type: ignore[call-arg]
    assert str(caught.value) == "unknown option(s) max_size for policy 'lru'; accepted: clock, ttl, idle_ttl"


def test_registry_cannot_be_changed_at_runtime() -> None:
    with pytest.raises(TypeError):
        POLICIES["lfu"] = LRUPolicy  # type: ignore[index]


def test_package_exports_what_its_all_names() -> None:
    for exported in prefixgate.policies.__all__:
        assert hasattr(prefixgate.policies, exported), exported
