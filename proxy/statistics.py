"""The engine's statistics, and their Prometheus text rendering for `/metrics`."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixgate.backends import AdmissionStats
from prefixgate.store import TierStats

# Seconds; from a cached short prompt to a cold 8k-token prefill on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class TenantStats:
    """One tenant's request and token counts since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache: prefill saved


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
    tenants: dict[str, TenantStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_request(
        self, prompt_tokens: int, cached_by_tier: dict[str, int], ttft: float, *, tenant: str = ""
    ) -> None:
        """Count a request that produced its first token, for the totals and for its tenant."""
        with self._lock:
            self.requests += 1
            counts = self.tenants.get(tenant, TenantStats())
            self.tenants[tenant] = TenantStats(
                counts.requests + 1,
                counts.prompt_tokens + prompt_tokens,
                counts.cached_tokens + sum(cached_by_tier.values()),
            )
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
        """Return a consistent copy of the counts the admin endpoint reports."""
        with self._lock:
            return EngineStatsSnapshot(
                requests=self.requests,
                errors=self.errors,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=dict(self.cached_tokens),
                tenants=dict(self.tenants),
            )

    def prometheus(
        self, tiers: Sequence[TierStats], admission: AdmissionStats | None = None, *, tenants: bool = False
    ) -> str:
        """Return the statistics, the store's and admission's, in Prometheus text exposition format.

        `tenants` adds each tenant's counts, labelled with its name.
        """
        with self._lock:
            lines = [
                *_counter("prefixgate_requests_total", "Requests that produced a first token.", self.requests),
                *_counter("prefixgate_request_errors_total", "Requests that failed before a token.", self.errors),
                *_counter(
                    "prefixgate_store_put_errors_total", "Computed blocks the store failed to keep.", self.store_errors
                ),
                *_counter(
                    "prefixgate_rejected_requests_total",
                    "Requests refused with 429: the wait queue was full.",
                    self.rejected,
                ),
                *_counter("prefixgate_prompt_tokens_total", "Prompt tokens of all requests.", self.prompt_tokens),
                *_counter(
                    "prefixgate_completion_tokens_total", "Tokens generated for all requests.", self.completion_tokens
                ),
                "# HELP prefixgate_cached_tokens_total Prompt tokens served from the cache, by tier.",
                "# TYPE prefixgate_cached_tokens_total counter",
                *(
                    f'prefixgate_cached_tokens_total{{tier="{tier.name}"}} {self.cached_tokens.get(tier.name, 0)}'
                    for tier in tiers
                ),
                "# HELP prefixgate_time_to_first_token_seconds Time from request to first token.",
                "# TYPE prefixgate_time_to_first_token_seconds histogram",
            ]
            running = 0
            for bound, count in zip((*TTFT_BUCKETS, float("inf")), self.ttft_buckets, strict=True):
                running += count
                label = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'prefixgate_time_to_first_token_seconds_bucket{{le="{label}"}} {running}')
            lines.append(f"prefixgate_time_to_first_token_seconds_sum {self.ttft_sum}")
            lines.append(f"prefixgate_time_to_first_token_seconds_count {running}")
            # Tenants come from the server's key table (or the in-process caller), never from a client: few labels.
            # Their names and traffic are private to whoever runs the server, so they are listed only when asked.
            if tenants:
                lines += self._tenant_lines()
        for name, help_text, attribute in (
            ("entries", "Blocks held, by tier.", "entries"),
            ("bytes", "Bytes held, by tier.", "bytes"),
            ("capacity_bytes", "Byte budget, by tier.", "capacity"),
        ):
            lines += [f"# HELP prefixgate_store_{name} {help_text}", f"# TYPE prefixgate_store_{name} gauge"]
            lines += [f'prefixgate_store_{name}{{tier="{t.name}"}} {getattr(t, attribute)}' for t in tiers]
        counters = (
            "hits",
            "misses",
            "evictions",
            "expirations",
            "promotions",
            "demotions",
            "corrupt",
            "dropped_writes",
        )
        for counter in counters:
            lines += [
                f"# HELP prefixgate_store_{counter}_total Block {counter.replace('_', ' ')}, by tier.",
                f"# TYPE prefixgate_store_{counter}_total counter",
            ]
            lines += [f'prefixgate_store_{counter}_total{{tier="{t.name}"}} {getattr(t, counter)}' for t in tiers]
        if admission is not None:
            for name, help_text, value in (
                ("running_requests", "Requests the model is running.", admission.running),
                ("waiting_requests", "Requests waiting for room to run.", admission.waiting),
                ("kv_memory_bytes", "KV memory reserved by running requests.", admission.bytes_in_use),
                ("kv_memory_budget_bytes", "KV memory running requests may reserve.", admission.budget_bytes),
            ):
                lines += [f"# HELP prefixgate_{name} {help_text}", f"# TYPE prefixgate_{name} gauge"]
                lines.append(f"prefixgate_{name} {value}")
        return "\n".join(lines) + "\n"

    def _tenant_lines(self) -> list[str]:
        lines = []
        for counted, help_text in (
            ("requests", "Requests that produced a first token, by tenant."),
            ("prompt_tokens", "Prompt tokens, by tenant."),
            ("cached_tokens", "Prompt tokens served from the cache, by tenant."),
        ):
            name = f"prefixgate_tenant_{counted}_total"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            lines += [
                f'{name}{{tenant="{_label_value(tenant)}"}} {getattr(counts, counted)}'
                for tenant, counts in sorted(self.tenants.items())
            ]
        return lines


@dataclass(frozen=True, slots=True)
class EngineStatsSnapshot:
    """The engine's counts at one moment, read under one lock so they agree with each other."""

    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: dict[str, int]  # per tier
    tenants: dict[str, TenantStats]

    @property
    def cached_total(self) -> int:
        """Return the prompt tokens served from the cache, over all tiers."""
        return sum(self.cached_tokens.values())


def _label_value(value: str) -> str:
    """Escape a Prometheus label value: backslash, double quote and line feed."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _counter(name: str, help_text: str, value: int) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
