"""Which upstream a request goes to: the one most likely to hold its prefix in its own KV cache, balanced against load.

An upstream (vLLM, SGLang, llama.cpp's server, another prefixgate) keeps its own prefix cache, which prefixgate cannot
see. So the router remembers what it sent where: a prompt's text is cut into chained keys (`text_keys`, one per
`BLOCK_CHARS` of text, each naming its chunk and everything before it, as the store's block keys do), and each key
maps to the upstreams that were sent a prompt starting with it. A request goes to the upstream holding the longest run
of its keys, the way the cache-aware routers of vLLM's production stack and SGLang choose:

- when that run covers at least `cache_threshold` of the prompt, to the upstream holding it;
- otherwise to the request's hint (OpenAI's `prompt_cache_key`, or `user`) hashed over the upstreams, so requests
  that share a hint share an upstream before any of them has a prefix there; with no hint, to the upstream least
  recently chosen for a miss, so distinct prompts spread;
- but never to a busy upstream while another is idle: when the chosen one has `balance_abs` more requests in flight
  than the least loaded one and `balance_rel` times as many, the least loaded one takes it (a hot prefix spreads
  once its replica is saturated, rather than piling up).

Only healthy upstreams are chosen. One that fails, a request or a health check, is out of rotation until its backoff
is over (doubling with each failure in a row, on an injected clock) or a health check finds it answering again; after
its backoff it takes requests again, and the first that succeeds makes it healthy.
The table of keys is bounded (`max_keys`, least recently used go first), so memory does not grow with traffic.
The router holds no locks: call it from one event loop.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

BLOCK_CHARS = 256  # characters of prompt text per key: about 64 tokens of English
DEFAULT_CACHE_THRESHOLD = 0.3
DEFAULT_BALANCE_ABS = 4
DEFAULT_BALANCE_REL = 1.5
DEFAULT_MAX_KEYS = 1 << 20  # about 200 MB of prompts remembered, at 100 bytes a key
_MAX_DOUBLINGS = 30


def text_keys(text: str, seed: bytes = b"") -> list[bytes]:
    """Return the chained keys of every full `BLOCK_CHARS` chunk of `text`: key i names chunks 0..i."""
    keys = []
    previous = xxhash.xxh3_128_digest(seed)
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        previous = xxhash.xxh3_128_digest(previous + text[start : start + BLOCK_CHARS].encode())
        keys.append(previous)
    return keys


@dataclass(slots=True, eq=False)  # compared and hashed as itself: one object per upstream
class Upstream:
    """One upstream and what the router knows of it now."""

    url: str
    in_flight: int = 0
    failures: int = 0  # failed requests in a row
    epoch: int = 0  # bumped when it fails: what it was sent before may be gone (a restart empties its cache)
    retry_at: float = 0.0  # when an upstream that failed may be tried again
    requests: int = 0  # requests sent to it so far
    prompt_tokens: int = 0  # of finished requests, as it reported them
    cached_tokens: int = 0  # of those, served from its own prefix cache
    last_miss: int = 0  # the router's count of misses when it last took one: the least recent takes the next

    def usable(self, now: float) -> bool:
        """Return whether it may take a request: healthy, or its backoff is over (then the request is a try)."""
        return self.failures == 0 or now >= self.retry_at


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request goes, and why."""

    upstream: Upstream
    matched: int  # leading keys of the prompt the upstream was sent before
    total: int  # keys of the prompt
    reason: str  # "prefix", "hint", "spread" or "load"
    displaced: Upstream | None = None  # for "load": the upstream chosen before its load sent the request elsewhere


class PrefixRouter:
    """Choose an upstream for each request by the prefix it was sent before, its hint and its load."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        cache_threshold: float = DEFAULT_CACHE_THRESHOLD,
        balance_abs: int = DEFAULT_BALANCE_ABS,
        balance_rel: float = DEFAULT_BALANCE_REL,
        max_keys: int = DEFAULT_MAX_KEYS,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls or len(set(urls)) != len(urls):
            raise ValueError(f"a router needs one or more distinct upstream URLs, got {list(urls)}")
        self.upstreams = tuple(Upstream(url) for url in urls)
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._max_keys = max_keys
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._clock = clock
        # key -> the upstreams sent a prompt starting with it, each with its epoch then; least recently used first
        self._held: OrderedDict[bytes, dict[Upstream, int]] = OrderedDict()
        self._misses = 0

    def choose(
        self,
        keys: Sequence[bytes],
        hint: str | None = None,
        *,
        exclude: Sequence[Upstream] = (),
        record: bool = True,
    ) -> Route:
        """Return where a prompt with these keys goes; raise LookupError when no upstream may take it now.

        `exclude` leaves out upstreams already tried for this request; `record=False` leaves the router as it was
        (for a dry run: a miss it routes does not move the spread on).
        """
        now = self._clock()
        candidates = [upstream for upstream in self.upstreams if upstream.usable(now) and upstream not in exclude]
        if not candidates:
            raise LookupError("no upstream is available: every one failed recently and is waiting out its backoff")
        matched = self.matched(keys, candidates)
        best = max(candidates, key=lambda upstream: (matched[upstream], -upstream.in_flight))
        if keys and matched[best] >= self.cache_threshold * len(keys):
            chosen, reason = best, "prefix"
        elif hint:
            chosen, reason = _rendezvous(hint, candidates), "hint"
        else:
            chosen, reason = min(candidates, key=lambda upstream: (upstream.last_miss, upstream.in_flight)), "spread"
        idlest = min(candidates, key=lambda upstream: upstream.in_flight)
        displaced = None
        if (
            chosen.in_flight - idlest.in_flight >= self.balance_abs
            and chosen.in_flight >= self.balance_rel * idlest.in_flight
        ):
            chosen, reason, displaced = idlest, "load", chosen
        if reason != "prefix" and record:
            self._misses += 1
            chosen.last_miss = self._misses
        return Route(chosen, matched[chosen], len(keys), reason, displaced)

    def matched(self, keys: Sequence[bytes], upstreams: Sequence[Upstream] | None = None) -> dict[Upstream, int]:
        """Return how many leading `keys` each upstream (every one by default) was sent."""
        return {upstream: self._run(keys, upstream) for upstream in upstreams or self.upstreams}

    def sent(self, upstream: Upstream, keys: Sequence[bytes]) -> None:
        """Record that `upstream` was sent a prompt with these keys: from now on it likely holds that prefix."""
        for key in keys:
            holders = self._held.get(key)
            if holders is None:
                holders = self._held[key] = {}
            else:
                self._held.move_to_end(key)
            holders[upstream] = upstream.epoch
        while len(self._held) > self._max_keys:
            self._held.popitem(last=False)

    def started(self, upstream: Upstream) -> None:
        """Count a request in flight on `upstream`."""
        upstream.in_flight += 1
        upstream.requests += 1

    def finished(self, upstream: Upstream, *, ok: bool) -> None:
        """Count a request that ended; one that failed takes its upstream out of rotation for a backoff."""
        upstream.in_flight -= 1
        self.checked(upstream, ok=ok)

    def checked(self, upstream: Upstream, *, ok: bool) -> None:
        """Record whether `upstream` answered, a request or a health check: one that answered is in rotation; one
        that failed is out of it for a backoff, and what it was sent is forgotten (a restart empties its cache)."""
        if ok:
            upstream.failures = 0
            return
        upstream.failures += 1
        delay = min(self._max_backoff, self._backoff * 2.0 ** min(upstream.failures - 1, _MAX_DOUBLINGS))
        upstream.retry_at = self._clock() + delay
        upstream.epoch += 1

    def _run(self, keys: Sequence[bytes], upstream: Upstream) -> int:
        """Return how many leading `keys` `upstream` was sent."""
        run = 0
        for key in keys:
            holders = self._held.get(key)
            if holders is None or holders.get(upstream) != upstream.epoch:
                break
            run += 1
        return run


def _rendezvous(hint: str, upstreams: Sequence[Upstream]) -> Upstream:
    """Return the upstream a hint hashes to: the same one while it is available, and few others move when one leaves."""
    return max(upstreams, key=lambda upstream: hashlib.blake2b(f"{hint}\0{upstream.url}".encode()).digest())
