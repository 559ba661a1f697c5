"""The engine's statistics as Prometheus reads them: names, types, values and labels, rendered by prometheus_client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

from prometheus_client import CollectorRegistry, generate_latest

from prefixgate.backends import AdmissionStats
from prefixgate.proxy.statistics import EngineCollector, EngineStats
from prefixgate.store import TierStats
from tests.proxy.conftest import metric_families, sample

MODEL_NAME = "org/tiny-llama"
IDLE = AdmissionStats(running=0, waiting=0, bytes_in_use=0, budget_bytes=1000, max_running=8, max_waiting=12)


def make_tier(name: str, **counts: int) -> TierStats:
    """Return a tier's stats: zero everywhere but `counts`."""
    values = {field.name: 0 for field in fields(TierStats) if field.name != "problem"} | {"name": name} | counts
    return TierStats(**values)


TIERS = (make_tier("host", entries=4, bytes=4096, capacity=8192, hits=3), make_tier("disk", misses=2, corrupt=1))


def render(
    stats: EngineStats,
    *,
    tiers: Sequence[TierStats] = TIERS,
    admission: AdmissionStats = IDLE,
    tenants: bool = False,
) -> str:
    """Return what `/metrics` would answer for these statistics."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, lambda: tiers, lambda: admission, model_name=MODEL_NAME, tenants=tenants))
    return generate_latest(registry).decode()


def test_every_metric_has_a_type_a_help_text_and_vllms_name_where_one_exists() -> None:
    families = metric_families(render(EngineStats()))
    expected = {
        "prefixgate_prefix_cache_queries": "counter",
        "prefixgate_prefix_cache_hits": "counter",
        "prefixgate_prefix_cache_hits_by_tier": "counter",
        "prefixgate_prompt_tokens": "counter",
        "prefixgate_generation_tokens": "counter",
        "prefixgate_time_to_first_token_seconds": "histogram",
        "prefixgate_num_requests_running": "gauge",
        "prefixgate_num_requests_waiting": "gauge",
        "prefixgate_requests": "counter",
        "prefixgate_request_errors": "counter",
        "prefixgate_rejected_requests": "counter",
        "prefixgate_store_put_errors": "counter",
        "prefixgate_prefill_seconds_saved": "counter",
        "prefixgate_kv_memory_bytes": "gauge",
        "prefixgate_kv_memory_budget_bytes": "gauge",
        "prefixgate_kv_shared_prefixes": "gauge",
        "prefixgate_kv_shared_bytes": "gauge",
        "prefixgate_store_entries": "gauge",
        "prefixgate_store_bytes": "gauge",
        "prefixgate_store_capacity_bytes": "gauge",
        "prefixgate_store_failing": "gauge",
        **{
            f"prefixgate_store_{counter}": "counter"
            for counter in (
                "hits",
                "misses",
                "evictions",
                "expirations",
                "promotions",
                "demotions",
                "corrupt",
                "dropped_writes",
                "failed_writes",
                "failed_reads",
                "set_aside",
            )
        },
    }
    assert {name: family.type for name, family in families.items()} == expected
    assert all(family.documentation for family in families.values())


def test_prefix_cache_queries_and_hits_count_prompt_tokens_under_the_same_labels() -> None:
    stats = EngineStats()
    stats.count_request(100, {}, 0.2)  # cold: every token looked up, none found
    stats.count_request(100, {"host": 64, "disk": 32}, 0.01)
    stats.count_request(40, {"host": 32}, 0.003)
    stats.count_completion(7)
    families = metric_families(render(stats))
    queries = families["prefixgate_prefix_cache_queries"].samples
    hits = families["prefixgate_prefix_cache_hits"].samples
    # rate(hits) / rate(queries) needs both to carry exactly the same labels: no tier on either.
    assert [found.labels for found in queries] == [found.labels for found in hits] == [{"model_name": MODEL_NAME}]
    assert (queries[0].value, hits[0].value) == (240, 128)
    assert sample(families, "prefixgate_prompt_tokens_total") == 240
    assert sample(families, "prefixgate_generation_tokens_total") == 7
    assert sample(families, "prefixgate_prefix_cache_hits_by_tier_total", tier="host") == 96
    assert sample(families, "prefixgate_prefix_cache_hits_by_tier_total", tier="disk") == 32


def test_time_to_first_token_buckets_are_cumulative_and_count_every_request() -> None:
    stats = EngineStats()
    for seconds in (0.003, 0.2, 0.2, 100.0):  # the last is past every bound but +Inf
        stats.count_request(10, {}, seconds)
    families = metric_families(render(stats))

    def bucket(le: str) -> float:
        return sample(families, "prefixgate_time_to_first_token_seconds_bucket", le=le)

    assert (bucket("0.005"), bucket("0.1"), bucket("0.25"), bucket("60.0"), bucket("+Inf")) == (1, 1, 3, 3, 4)
    assert sample(families, "prefixgate_time_to_first_token_seconds_count", model_name=MODEL_NAME) == 4
    assert sample(families, "prefixgate_time_to_first_token_seconds_sum") == 100.403


def test_admission_gauges_and_store_metrics_by_tier() -> None:
    busy = AdmissionStats(
        running=3,
        waiting=5,
        bytes_in_use=600,
        budget_bytes=1000,
        max_running=8,
        max_waiting=12,
        shared_prefixes=1,
        shared_bytes=256,
    )
    families = metric_families(render(EngineStats(), admission=busy))
    assert sample(families, "prefixgate_num_requests_running", model_name=MODEL_NAME) == 3
    assert sample(families, "prefixgate_num_requests_waiting", model_name=MODEL_NAME) == 5
    assert sample(families, "prefixgate_kv_memory_bytes") == 600
    assert sample(families, "prefixgate_kv_memory_budget_bytes") == 1000
    assert sample(families, "prefixgate_kv_shared_prefixes") == 1
    assert sample(families, "prefixgate_kv_shared_bytes") == 256
    # The store knows no models: its metrics carry the tier only.
    assert [found.labels for found in families["prefixgate_store_entries"].samples] == [
        {"tier": "host"},
        {"tier": "disk"},
    ]
    assert sample(families, "prefixgate_store_capacity_bytes", tier="host") == 8192
    assert sample(families, "prefixgate_store_hits_total", tier="host") == 3
    assert sample(families, "prefixgate_store_misses_total", tier="disk") == 2
    assert sample(families, "prefixgate_store_corrupt_total", tier="disk") == 1


def test_metrics_are_read_at_each_scrape() -> None:
    stats = EngineStats()
    registry = CollectorRegistry()
    registry.register(EngineCollector(stats, lambda: TIERS, lambda: IDLE, model_name=MODEL_NAME))
    assert sample(metric_families(generate_latest(registry).decode()), "prefixgate_requests_total") == 0
    stats.count_request(10, {}, 0.1)
    stats.count_rejected()
    families = metric_families(generate_latest(registry).decode())
    assert sample(families, "prefixgate_requests_total") == 1
    assert sample(families, "prefixgate_rejected_requests_total") == 1


def test_tenant_counters_are_labelled_and_their_names_escaped() -> None:
    tenant = 'team "a"\\b\nc'
    stats = EngineStats()
    stats.count_request(100, {"host": 64}, 0.2, tenant=tenant, saved_seconds=0.5)
    stats.count_request(50, {}, 0.4, tenant="")
    stats.count_request(100, {"disk": 96}, 0.1, tenant=tenant, saved_seconds=0.75)
    text = render(stats, tenants=True)
    assert 'tenant="team \\"a\\"\\\\b\\nc"' in text  # one line, quotes and backslash escaped
    families = metric_families(text)
    assert families["prefixgate_tenant_requests"].type == "counter"
    assert sample(families, "prefixgate_tenant_requests_total", tenant=tenant) == 2
    assert sample(families, "prefixgate_tenant_prompt_tokens_total", tenant=tenant) == 200
    assert sample(families, "prefixgate_tenant_cached_tokens_total", tenant=tenant) == 160
    assert sample(families, "prefixgate_tenant_cached_tokens_total", tenant="", model_name=MODEL_NAME) == 0
    assert sample(families, "prefixgate_tenant_prefill_seconds_saved_total", tenant=tenant) == 1.25
    assert sample(families, "prefixgate_prefill_seconds_saved_total") == 1.25


def test_tenant_counters_are_left_out_unless_asked_for() -> None:
    stats = EngineStats()
    stats.count_request(100, {"host": 64}, 0.2, tenant="acme")
    text = render(stats)
    assert sample(metric_families(text), "prefixgate_requests_total") == 1
    assert "acme" not in text and "prefixgate_tenant_" not in text
