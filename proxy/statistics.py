"""The engine's statistics, and the Prometheus collector that reads them for `/metrics`."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from prefixgate.backends import AdmissionStats
from prefixgate.backends.router import Upstream
from prefixgate.proxy.settings import ModelPrices
from prefixgate.store import TierStats
from prefixgate.store.redis_tier import RedisStats

CACHED_BY_UPSTREAMS = "upstream"  # the tier name under which upstreams' cached tokens are counted

# Seconds; from a cached short prompt to a cold 8k-token prefill on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's request and token counts since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache: prefill saved
    saved_seconds: float = 0.0  # the prefill time those spared, estimated


@dataclass
class EngineStats:
    """Counts of requests, tokens and cache hits since the engine started; safe to update from any thread."""

    requests: int = 0
    errors: int = 0
    rejected: int = 0
    store_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)  # per tier
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))
    ttft_sum: float = 0.0
    saved_seconds: float = 0.0  # prefill time the cache spared, estimated at the model's measured rate
    cache_write_tokens: int = 0  # prompt tokens computed and stored at a client's breakpoint
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_request(
        self,
        prompt_tokens: int,
        cached_by_tier: dict[str, int],
        ttft: float,
        *,
        tenant: str = "",
        saved_seconds: float = 0.0,
        cache_write_tokens: int = 0,
    ) -> None:
        """Count a request that produced its first token, for the totals and for its tenant."""
        with self._lock:
            self.requests += 1
            counts = self.tenants.get(tenant, TenantStats())
            self.tenants[tenant] = TenantStats(
                counts.requests + 1,
                counts.prompt_tokens + prompt_tokens,
                counts.cached_tokens + sum(cached_by_tier.values()),
                counts.saved_seconds + saved_seconds,
            )
            self.saved_seconds += saved_seconds
            self.cache_write_tokens += cache_write_tokens
            self.prompt_tokens += prompt_tokens
            for tier, tokens in cached_by_tier.items():
                self.cached_tokens[tier] = self.cached_tokens.get(tier, 0) + tokens
            self.ttft_buckets[bisect_left(TTFT_BUCKETS, ttft)] += 1
            self.ttft_sum += ttft

    def count_completion(self, tokens: int) -> None:
        """Count the tokens a finished request generated."""
        with self._lock:
            self.completion_tokens += tokens

    def count_rejected(self) -> None:
        """Count a request refused because the server was at capacity."""
        with self._lock:
            self.rejected += 1

    def count_store_error(self) -> None:
        """Count a computed block the store failed to keep."""
        with self._lock:
            self.store_errors += 1

    def count_error(self) -> None:
        """Count a request that failed before its first token."""
        with self._lock:
            self.errors += 1

    def snapshot(self) -> EngineStatsSnapshot:
        """Return a consistent copy of every count, for the admin endpoint and `/metrics`."""
        with self._lock:
            return EngineStatsSnapshot(
                requests=self.requests,
                errors=self.errors,
                rejected=self.rejected,
                store_errors=self.store_errors,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=dict(self.cached_tokens),
                ttft_buckets=tuple(self.ttft_buckets),
                ttft_sum=self.ttft_sum,
                saved_seconds=self.saved_seconds,
                cache_write_tokens=self.cache_write_tokens,
                tenants=dict(self.tenants),
            )


@dataclass(frozen=True, slots=True)
class EngineStatsSnapshot:
    """The engine's counts at one moment, read under one lock so they agree with each other."""

    requests: int
    errors: int
    rejected: int
    store_errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: dict[str, int]  # per tier
    ttft_buckets: tuple[int, ...]  # requests up to each TTFT_BUCKETS bound from the one before, then past the last
    ttft_sum: float
    saved_seconds: float
    cache_write_tokens: int
    tenants: dict[str, TenantStats]

    @property
    def cached_total(self) -> int:
        """Return the prompt tokens served from the cache, over all tiers."""
        return sum(self.cached_tokens.values())


def cost_saved(prices: ModelPrices, cached_tokens: int) -> float:
    """Return what serving `cached_tokens` from the cache saved at these prices: the input price less the cached."""
    return cached_tokens * (prices.input - prices.cached_input) / 1e6


def cost(prices: ModelPrices, stats: EngineStatsSnapshot) -> float:
    """Return what requests cost at these prices: prompt tokens computed, those from the cache, those computed and
    stored at a breakpoint (cache writes), and the answers."""
    cached, written = stats.cached_total, stats.cache_write_tokens
    computed = stats.prompt_tokens - cached - written
    return (
        computed * prices.input
        + cached * prices.cached_input
        + written * prices.cache_write
        + stats.completion_tokens * prices.output
    ) / 1e6


class EngineCollector(Collector):
    """Read the engine's counts, its store's tiers and its admission at each scrape, as Prometheus metrics.

    Names follow Prometheus's conventions, and vLLM's where they mean the same thing (`prefixgate_` for `vllm:`), so
    dashboards and alerts made for vLLM carry over. The engine's metrics carry `model_name` as vLLM's do; the store's
    carry only `tier`, because the store knows no models (one disk tier may hold blocks of several).
    `collect` reads the store's tiers, which touches LMDB: call it, or `generate_latest`, off the event loop.
    """

    def __init__(
        self,
        stats: EngineStats,
        tiers: Callable[[], Sequence[TierStats]] = lambda: (),
        admission: Callable[[], AdmissionStats] | None = None,
        *,
        model_name: str,
        remote: Callable[[], RedisStats | None] = lambda: None,
        upstreams: Callable[[], Sequence[Upstream]] = lambda: (),
        tenants: bool = False,
        prices: ModelPrices | None = None,
    ) -> None:
        self._stats = stats
        self._tiers = tiers
        self._admission = admission
        self._remote = remote
        self._upstreams = upstreams
        self._model_name = model_name
        # Tenants come from the server's key table (or the in-process caller), never from a client: few labels.
        # Their names and traffic are private to whoever runs the server, so they are listed only when asked.
        self._tenants = tenants
        self._prices = prices

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family, read now."""
        stats, tiers, remote, upstreams = self._stats.snapshot(), self._tiers(), self._remote(), self._upstreams()
        names = [tier.name for tier in tiers] + ([remote.name] if remote is not None else [])
        yield from self._engine_metrics(stats, names + ([CACHED_BY_UPSTREAMS] if upstreams else []))
        if self._admission is not None:
            yield from self._admission_gauges(self._admission())
        yield from _store_metrics(tiers)
        if remote is not None:
            yield from _remote_metrics(remote)
        if upstreams:
            yield from self._upstream_metrics(upstreams)
        if self._tenants:
            yield from self._tenant_counters(stats.tenants)

    def _engine_metrics(self, stats: EngineStatsSnapshot, tiers: Sequence[str]) -> Iterator[Metric]:
        model = self._model_name
        # Every prompt is looked up from its first token, so the queries are the prompt tokens. They and the hits are
        # counted together, when a request's first token is out, so hits never exceed queries; and both carry the
        # same labels, so rate(hits) / rate(queries) is the hit rate, as with vLLM's.
        for name, help_text, value in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prompt_tokens),
            ("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.cached_total),
            ("prompt_tokens", "Prompt tokens of requests that produced a first token.", stats.prompt_tokens),
            ("generation_tokens", "Tokens generated.", stats.completion_tokens),
            ("requests", "Requests that produced a first token.", stats.requests),
            ("request_errors", "Requests that failed before their first token.", stats.errors),
            ("rejected_requests", "Requests refused with 429 because the wait queue was full.", stats.rejected),
            ("store_put_errors", "Computed blocks the store failed to keep.", stats.store_errors),
            (
                "prefill_seconds_saved",
                "Prefill time the prefix cache spared, estimated at the model's measured prefill rate.",
                stats.saved_seconds,
            ),
        ):
            yield _family(CounterMetricFamily, f"prefixgate_{name}", help_text, ["model_name"], [([model], value)])
        if self._prices is not None:
            saved = cost_saved(self._prices, stats.cached_total)
            help_text = "What the prefix cache saved at the configured prices (in their currency)."
            yield _family(CounterMetricFamily, "prefixgate_cost_saved", help_text, ["model_name"], [([model], saved)])
        yield _family(
            CounterMetricFamily,
            "prefixgate_prefix_cache_hits_by_tier",
            "Prompt tokens served from the prefix cache, by the tier they came from.",
            ["model_name", "tier"],
            [([model, tier], stats.cached_tokens.get(tier, 0)) for tier in tiers],
        )
        ttft = HistogramMetricFamily(
            "prefixgate_time_to_first_token_seconds",
            "Seconds from a request reaching the engine to its first token.",
            labels=["model_name"],
        )
        bounds = [*map(floatToGoString, TTFT_BUCKETS), "+Inf"]
        ttft.add_metric([model], list(zip(bounds, accumulate(stats.ttft_buckets), strict=True)), stats.ttft_sum)
        yield ttft

    def _admission_gauges(self, admission: AdmissionStats) -> Iterator[Metric]:
        for name, help_text, value in (
            ("num_requests_running", "Requests the model is running.", admission.running),
            ("num_requests_waiting", "Requests waiting for room to run.", admission.waiting),
            ("kv_memory_bytes", "KV memory reserved by running requests, in bytes.", admission.bytes_in_use),
            ("kv_memory_budget_bytes", "KV memory running requests may reserve, in bytes.", admission.budget_bytes),
            ("kv_shared_prefixes", "Cached prefixes running requests read in place.", admission.shared_prefixes),
            ("kv_shared_bytes", "Shared prefixes' KV, in the top tier (not kv_memory_bytes).", admission.shared_bytes),
        ):
            yield _family(
                GaugeMetricFamily, f"prefixgate_{name}", help_text, ["model_name"], [([self._model_name], value)]
            )

    def _upstream_metrics(self, upstreams: Sequence[Upstream]) -> Iterator[Metric]:
        running = sum(upstream.in_flight for upstream in upstreams)
        yield _family(
            GaugeMetricFamily,
            "prefixgate_num_requests_running",
            "Requests the upstreams are answering.",
            ["model_name"],
            [([self._model_name], running)],
        )
        for name, kind, help_text, attribute in (
            ("upstream_up", GaugeMetricFamily, "1 while the upstream is in rotation.", None),
            ("upstream_in_flight", GaugeMetricFamily, "Requests the upstream is answering.", "in_flight"),
            ("upstream_requests", CounterMetricFamily, "Requests sent to the upstream.", "requests"),
            ("upstream_prompt_tokens", CounterMetricFamily, "Prompt tokens the upstream reported.", "prompt_tokens"),
            (
                "upstream_cached_tokens",
                CounterMetricFamily,
                "Prompt tokens the upstream reported served from its own prefix cache.",
                "cached_tokens",
            ),
        ):
            samples = [
                ([upstream.url], int(upstream.failures == 0) if attribute is None else getattr(upstream, attribute))
                for upstream in upstreams
            ]
            yield _family(kind, f"prefixgate_{name}", help_text, ["upstream"], samples)

    def _tenant_counters(self, tenants: dict[str, TenantStats]) -> Iterator[Metric]:
        for name, attribute, help_text in (
            ("requests", "requests", "Requests that produced a first token, by tenant."),
            ("prompt_tokens", "prompt_tokens", "Prompt tokens, by tenant."),
            ("cached_tokens", "cached_tokens", "Prompt tokens served from the prefix cache, by tenant."),
            ("prefill_seconds_saved", "saved_seconds", "Prefill time the prefix cache spared, estimated, by tenant."),
        ):
            samples = [
                ([self._model_name, tenant], getattr(counts, attribute)) for tenant, counts in sorted(tenants.items())
            ]
            yield _family(
                CounterMetricFamily, f"prefixgate_tenant_{name}", help_text, ["model_name", "tenant"], samples
            )
        if self._prices is not None:
            prices = self._prices
            samples = [
                ([self._model_name, tenant], cost_saved(prices, counts.cached_tokens))
                for tenant, counts in sorted(tenants.items())
            ]
            help_text = "What the prefix cache saved at the configured prices, by tenant."
            yield _family(
                CounterMetricFamily, "prefixgate_tenant_cost_saved", help_text, ["model_name", "tenant"], samples
            )


def _store_metrics(tiers: Sequence[TierStats]) -> Iterator[Metric]:
    for name, help_text, attribute in (
        ("entries", "Blocks held, by tier.", "entries"),
        ("bytes", "Bytes held, by tier.", "bytes"),
        ("capacity_bytes", "Byte budget, by tier.", "capacity"),
    ):
        samples = [([tier.name], getattr(tier, attribute)) for tier in tiers]
        yield _family(GaugeMetricFamily, f"prefixgate_store_{name}", help_text, ["tier"], samples)
    failing = [([tier.name], float(tier.problem is not None)) for tier in tiers]
    yield _family(
        GaugeMetricFamily, "prefixgate_store_failing", "1 while a tier fails (see /health), by tier.", ["tier"], failing
    )
    for counter, help_text in (
        ("hits", "Blocks found in this tier, by tier."),
        ("misses", "Blocks looked up and not found in this tier, by tier."),
        ("evictions", "Blocks removed from this tier for room and not kept below it, by tier."),
        ("expirations", "Blocks removed from this tier because their time to live ran out, by tier."),
        ("promotions", "Blocks found in this tier and moved up to the top tier, by tier."),
        ("demotions", "Blocks moved from this tier down to the next one for room, by tier."),
        ("corrupt", "Blocks dropped from this tier because their tokens or checksum did not match, by tier."),
        ("dropped_writes", "Blocks not written to this tier because its writer was too far behind, by tier."),
        ("failed_writes", "Blocks this tier failed to write (a full or failing disk), by tier."),
        ("failed_reads", "Reads that failed in this tier (a damaged file), by tier."),
        ("set_aside", "Damaged stores of this tier set aside at start for an empty one, by tier."),
    ):
        samples = [([tier.name], getattr(tier, counter)) for tier in tiers]
        yield _family(CounterMetricFamily, f"prefixgate_store_{counter}", help_text, ["tier"], samples)


def _remote_metrics(remote: RedisStats) -> Iterator[Metric]:
    # Redis holds every replica's blocks under its own eviction: this server reports only what it did there.
    yield _family(
        GaugeMetricFamily,
        "prefixgate_remote_up",
        "1 when Redis answered this server's last request.",
        [],
        [([], int(remote.available))],
    )
    yield _family(
        GaugeMetricFamily,
        "prefixgate_remote_queued_bytes",
        "Bytes of blocks waiting to be sent to Redis.",
        [],
        [([], remote.queued_bytes)],
    )
    for counter, help_text in (
        ("hits", "Blocks this server found in Redis."),
        ("misses", "Lookups in Redis that ended before the end of the chain asked for."),
        ("promotions", "Blocks found in Redis and kept in this server's top tier."),
        ("corrupt", "Blocks found in Redis whose tokens or checksum did not match, deleted there."),
        ("errors", "Requests to Redis that failed or timed out."),
        ("round_trips", "Reads from Redis, each one round trip: a chain of blocks streams in one."),
        ("writes", "Blocks this server wrote to Redis."),
        ("written_bytes", "Bytes this server wrote to Redis."),
        ("dropped_writes", "Blocks not written to Redis: its writer too far behind, Redis down or out of memory."),
    ):
        samples: list[tuple[list[str], float]] = [([], getattr(remote, counter))]
        yield _family(CounterMetricFamily, f"prefixgate_remote_{counter}", help_text, [], samples)


def _family(
    kind: type[CounterMetricFamily | GaugeMetricFamily],
    name: str,
    help_text: str,
    labels: Sequence[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> Metric:
    """Return a counter or gauge family with one sample per (label values, value) pair."""
    family = kind(name, help_text, labels=labels)
    for label_values, value in samples:
        family.add_metric(label_values, value)
    return family
