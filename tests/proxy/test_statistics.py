"""The engine's statistics as Prometheus text: per-tenant counters, with label values escaped."""

from __future__ import annotations

from prefixgate.proxy.statistics import EngineStats


def test_tenant_counters_are_labelled_and_escaped() -> None:
    stats = EngineStats()
    stats.count_request(100, {"host": 64}, 0.2, tenant='team "a"\\b')
    stats.count_request(50, {}, 0.4, tenant="")
    stats.count_request(100, {"disk": 96}, 0.1, tenant='team "a"\\b')
    lines = stats.prometheus([], tenants=True).splitlines()
    assert 'prefixgate_tenant_requests_total{tenant="team \\"a\\"\\\\b"} 2' in lines
    assert 'prefixgate_tenant_prompt_tokens_total{tenant="team \\"a\\"\\\\b"} 200' in lines
    assert 'prefixgate_tenant_cached_tokens_total{tenant="team \\"a\\"\\\\b"} 160' in lines
    assert 'prefixgate_tenant_cached_tokens_total{tenant=""} 0' in lines
    assert "# TYPE prefixgate_tenant_requests_total counter" in lines


def test_tenant_counters_are_left_out_unless_asked_for() -> None:
    stats = EngineStats()
    stats.count_request(100, {"host": 64}, 0.2, tenant="acme")
    text = stats.prometheus([])
    assert "prefixgate_requests_total 1" in text
    assert "acme" not in text and "prefixgate_tenant_" not in text
