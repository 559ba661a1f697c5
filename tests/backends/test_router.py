"""The prefix router: affinity by what was sent where, hints, spreading, load balance, health and a bounded table."""

from __future__ import annotations

import pytest

from prefixgate.backends.router import BLOCK_CHARS, PrefixRouter, Upstream, text_keys
from tests.fake_clock import FakeClock

A, B, C = "http://a:8000/v1", "http://b:8000/v1", "http://c:8000/v1"
SYSTEM = "You answer questions about the handbook. " * 40  # about six keys


def named(router: PrefixRouter, url: str) -> Upstream:
    return next(upstream for upstream in router.upstreams if upstream.url == url)


def send(router: PrefixRouter, text: str, hint: str | None = None) -> str:
    """Route a prompt, count it as sent and finished, and return the URL it went to."""
    keys = text_keys(text)
    route = router.choose(keys, hint)
    router.started(route.upstream)
    router.sent(route.upstream, keys)
    router.finished(route.upstream, ok=True)
    return route.upstream.url


def test_keys_are_chained_over_whole_chunks_of_text() -> None:
    text = "x" * (3 * BLOCK_CHARS + 10)
    keys = text_keys(text)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert text_keys(text + " and more")[:3] == keys  # a longer prompt shares the prefix's keys
    assert text_keys("y" + text[1:])[0] != keys[0] and text_keys("y" + text[1:])[2] != keys[2]  # keys name all before
    assert text_keys(text, seed=b"tenant")[0] != keys[0]
    assert text_keys("short") == []


def test_repeated_prompts_stick_to_one_upstream_and_distinct_ones_spread() -> None:
    router = PrefixRouter([A, B])
    first = send(router, SYSTEM + "Question 1")
    assert {send(router, SYSTEM + f"Question {n}") for n in range(2, 8)} == {first}
    assert router.choose(text_keys(SYSTEM + "Question 9")).reason == "prefix"
    others = {send(router, f"Prompt number {n}. " * 60) for n in range(4)}
    assert others == {A, B}  # no prefix held anywhere: each miss goes to the upstream that took a miss longest ago


def test_a_short_shared_prefix_is_not_enough_to_stick() -> None:
    router = PrefixRouter([A, B], cache_threshold=0.5)
    long_tail = "x" * (10 * BLOCK_CHARS)
    first = send(router, SYSTEM[: 2 * BLOCK_CHARS] + long_tail)
    keys = text_keys(SYSTEM[: 2 * BLOCK_CHARS] + "y" * (10 * BLOCK_CHARS))
    route = router.choose(keys)
    assert (route.upstream.url != first, route.matched, route.total, route.reason) == (True, 0, 12, "spread")
    assert router.choose(keys, exclude=[route.upstream]).matched == 2  # the first holds 2 of 12: under half


def test_a_hint_keeps_requests_together_before_any_prefix_is_known() -> None:
    router = PrefixRouter([A, B, C])
    chosen = {send(router, f"Conversation turn {n}. " * 40, hint="user-42") for n in range(5)}
    assert len(chosen) == 1
    spread = {router.choose(text_keys(f"Other {n}. " * 40), hint=f"user-{n}").upstream.url for n in range(30)}
    assert spread == {A, B, C}


def test_a_hot_prefix_spills_to_the_idlest_upstream_once_its_own_is_saturated() -> None:
    router = PrefixRouter([A, B], balance_abs=2, balance_rel=1.5)
    keys = text_keys(SYSTEM + "Question")
    router.sent(named(router, A), keys)
    routes = []
    for _ in range(4):  # a burst: none of them finishes
        route = router.choose(keys)
        router.started(route.upstream)
        routes.append((route.upstream.url, route.reason))
    assert routes == [(A, "prefix"), (A, "prefix"), (B, "load"), (A, "prefix")]
    assert (named(router, A).in_flight, named(router, B).in_flight) == (3, 1)
    router.started(named(router, A))
    spilled = router.choose(keys)
    assert (spilled.upstream.url, spilled.reason, spilled.displaced) == (B, "load", named(router, A))


def test_a_failed_upstream_leaves_rotation_for_its_backoff_and_forgets_its_prefixes() -> None:
    clock = FakeClock()
    router = PrefixRouter([A, B], backoff=1.0, clock=clock)
    keys = text_keys(SYSTEM)
    router.sent(named(router, A), keys)
    route = router.choose(keys)
    assert route.upstream.url == A
    router.started(route.upstream)
    router.finished(route.upstream, ok=False)
    assert router.choose(keys).upstream.url == B
    with pytest.raises(LookupError, match="no upstream is available"):
        router.choose(keys, exclude=[named(router, B)])
    clock.advance(1.0)
    retry = router.choose(keys, exclude=[named(router, B)])
    assert retry.upstream.url == A and retry.matched == 0  # back, but what it held may be gone with a restart
    router.started(retry.upstream)
    router.finished(retry.upstream, ok=False)  # failed again: the backoff doubles
    clock.advance(1.5)
    assert not named(router, A).usable(clock.now)
    clock.advance(0.5)
    assert named(router, A).usable(clock.now)


def test_a_health_check_takes_an_upstream_out_and_brings_it_back_before_its_backoff_ends() -> None:
    clock = FakeClock()
    router = PrefixRouter([A, B], backoff=60.0, clock=clock)
    keys = text_keys(SYSTEM)
    router.sent(named(router, A), keys)
    router.checked(named(router, A), ok=False)
    assert router.choose(keys).upstream.url == B and not named(router, A).usable(clock.now)
    router.checked(named(router, A), ok=True)  # it answers again: no need to wait a minute
    back = router.choose(keys, exclude=[named(router, B)])
    assert back.upstream.url == A and back.matched == 0  # its cache may have gone with it


def test_a_dry_run_routes_as_a_request_would_and_changes_nothing() -> None:
    router = PrefixRouter([A, B])
    prompts = [text_keys(f"Prompt number {n}. " * 60) for n in range(3)]
    dry = [router.choose(keys, record=False).upstream.url for keys in prompts]
    assert dry == [dry[0]] * 3  # each dry run sees the router as the one before it left it
    assert router.choose(prompts[0]).upstream.url == dry[0]
    assert router.choose(prompts[1]).upstream.url != dry[0]  # a recorded miss moves the spread on
    assert router.matched(text_keys(SYSTEM)) == {named(router, A): 0, named(router, B): 0}


def test_the_table_forgets_the_least_recently_used_keys_first() -> None:
    router = PrefixRouter([A, B], max_keys=8)
    old, new = text_keys("old " * 400)[:6], text_keys("new " * 400)[:6]
    router.sent(named(router, A), old)
    router.sent(named(router, B), new)
    assert router.choose(new).upstream.url == B
    assert router.choose(old).matched == 0  # its first keys went first, and a prefix starts there


def test_urls_must_be_given_and_distinct() -> None:
    with pytest.raises(ValueError, match="distinct upstream URLs"):
        PrefixRouter([A, A])
    with pytest.raises(ValueError, match="one or more"):
        PrefixRouter([])
