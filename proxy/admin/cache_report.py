"""The cache report the admin endpoint serves: totals, tiers, tenants, entries and the longest cached prefixes.

Two kinds of numbers appear, and the names keep them apart. Request numbers come from the engine: `hit_tokens`
(prompt tokens served from the cache, which is the prefill `tokens_saved`) and `miss_tokens` (prompt tokens the model
computed). Lookup numbers come from the store's tiers: `hits` and `misses` count block lookups in a tier, and a tier's
`hit_tokens` and `miss_tokens` are those counts in tokens; its `tokens_saved` is the request number for that tier.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.proxy.settings import ModelPrices
from prefixgate.proxy.statistics import EngineStatsSnapshot, TenantStats, cost, cost_saved
from prefixgate.store import BlockKey, EntryInfo, TierStats
from prefixgate.store.redis_tier import RedisStats, RedisUsage

_EVENTS = ("evictions", "expirations", "promotions", "demotions", "corrupt", "dropped_writes")


@dataclass(frozen=True, slots=True)
class Prefix:
    """One chain of cached blocks, from its first present block to a block nothing cached extends."""

    leaf: BlockKey
    root: BlockKey
    blocks: int
    tokens: int  # every block's tokens: whole blocks, and a tail's fewer
    tenant: str
    tiers: dict[str, int]  # blocks of the chain held in each tier
    complete: bool  # whether the chain reaches block 0 (a chain missing its start cannot be hit)


def cache_report(
    tiers: Sequence[TierStats],
    stats: EngineStatsSnapshot,
    entries: Sequence[EntryInfo],
    block_size: int,
    remote: tuple[RedisStats, RedisUsage | None] | None = None,
    prices: ModelPrices | None = None,
) -> dict[str, Any]:
    """Return the `/admin/cache` body: totals, each local tier, the remote tier, and each tenant; what the requests
    cost and the cache saved, where the model has prices.

    Totals and tenants count what this server holds; the remote tier is shared, and reported beside them.
    """
    blocks = _blocks(entries)
    totals = {
        # A block held by two tiers (written through to disk, say) is one entry of its bytes; `stored_bytes` counts
        # every copy, as the tiers' own `bytes` and `capacity` do.
        "entries": len(blocks),
        "bytes": sum(blocks.values()),
        "stored_bytes": sum(tier.bytes for tier in tiers),
        "capacity": sum(tier.capacity for tier in tiers),
        "requests": stats.requests,
        **_tokens(stats.prompt_tokens, stats.cached_total),
        "prefill_seconds_saved": round(stats.saved_seconds, 3),
        "cache_write_tokens": stats.cache_write_tokens,
        **money(prices, stats),
        **{event: sum(getattr(tier, event) for tier in tiers) for event in _EVENTS},
    }
    return {
        "object": "cache",
        "block_size": block_size,
        "totals": totals,
        "tiers": [_tier(tier, stats, block_size) for tier in tiers],
        "remote": None if remote is None else _remote(*remote, stats, block_size),
        "tenants": _tenants(stats.tenants, entries, prices),
    }


def entry_body(entry: EntryInfo) -> dict[str, Any]:
    """Return one cached entry (one block in one tier) as JSON."""
    return {
        "key": entry.key.hex(),
        "tier": entry.tier,
        "tokens": entry.tokens,
        "bytes": entry.nbytes,
        "created": entry.created,
        "last_access": entry.last_access,
        "expires_at": entry.expires_at,
        "hits": entry.hits,
        "pinned": entry.pinned,
        "retained_until": entry.retained_until,
        "tenant": entry.tenant,
        "parent": entry.parent.hex() if entry.parent is not None else None,
    }


def sort_entries(entries: Sequence[EntryInfo], tier_order: Sequence[str]) -> list[EntryInfo]:
    """Return entries newest first, then by key and tier, so pages stay in place while nothing changes."""
    rank = {name: index for index, name in enumerate(tier_order)}
    return sorted(entries, key=lambda entry: (-entry.created, entry.key.digest, rank.get(entry.tier, len(rank))))


def longest_prefixes(entries: Sequence[EntryInfo], limit: int) -> list[Prefix]:
    """Return the `limit` longest chains of cached blocks, longest first."""
    by_key: dict[BlockKey, list[EntryInfo]] = defaultdict(list)
    for entry in entries:
        by_key[entry.key].append(entry)
    parents = {infos[0].parent for infos in by_key.values()}
    leaves = [key for key in by_key if key not in parents]
    depth: dict[BlockKey, int] = {}
    for leaf in leaves:
        _depth(leaf, by_key, depth)
    chosen = sorted(leaves, key=lambda key: (-depth[key], key.digest))[:limit]
    return [_prefix(leaf, by_key) for leaf in chosen]


def prefix_body(prefix: Prefix) -> dict[str, Any]:
    """Return one cached prefix as JSON."""
    return {
        "key": prefix.leaf.hex(),
        "root": prefix.root.hex(),
        "blocks": prefix.blocks,
        "tokens": prefix.tokens,
        "tenant": prefix.tenant,
        "tiers": prefix.tiers,
        "complete": prefix.complete,
    }


def _tier(tier: TierStats, stats: EngineStatsSnapshot, block_size: int) -> dict[str, Any]:
    return {
        "name": tier.name,
        "entries": tier.entries,
        "bytes": tier.bytes,
        "capacity": tier.capacity,
        "hits": tier.hits,
        "misses": tier.misses,
        "hit_tokens": tier.hits * block_size,
        "miss_tokens": tier.misses * block_size,
        "tokens_saved": stats.cached_tokens.get(tier.name, 0),
        **{event: getattr(tier, event) for event in _EVENTS},
    }


def _remote(tier: RedisStats, usage: RedisUsage | None, stats: EngineStatsSnapshot, block_size: int) -> dict[str, Any]:
    """The remote tier: its counters on this server, and what Redis holds (None where Redis did not answer)."""
    held = {
        "entries": usage.entries if usage is not None else None,  # every replica's blocks, of every model and tenant
        "used_memory": usage.used_memory if usage is not None else None,
        "maxmemory": usage.maxmemory if usage is not None else None,
        "maxmemory_policy": usage.maxmemory_policy if usage is not None else None,
    }
    return {
        "name": tier.name,
        "url": tier.url,
        "available": tier.available,
        **held,
        "hits": tier.hits,
        "misses": tier.misses,
        "hit_tokens": tier.hits * block_size,
        "tokens_saved": stats.cached_tokens.get(tier.name, 0),
        "errors": tier.errors,
        "round_trips": tier.round_trips,
        "writes": tier.writes,
        "written_bytes": tier.written_bytes,
        "queued_bytes": tier.queued_bytes,
        "promotions": tier.promotions,
        "corrupt": tier.corrupt,
        "dropped_writes": tier.dropped_writes,
    }


def _tenants(
    counts: dict[str, TenantStats], entries: Sequence[EntryInfo], prices: ModelPrices | None
) -> list[dict[str, Any]]:
    by_tenant: dict[str, list[EntryInfo]] = defaultdict(list)
    for entry in entries:
        by_tenant[entry.tenant].append(entry)
    report = []
    for tenant in sorted(set(counts) | set(by_tenant)):
        tenant_counts = counts.get(tenant, TenantStats())
        held = by_tenant.get(tenant, [])
        blocks = _blocks(held)
        report.append(
            {
                "tenant": tenant,
                "entries": len(blocks),
                "bytes": sum(blocks.values()),
                "stored_bytes": sum(entry.nbytes for entry in held),
                "requests": tenant_counts.requests,
                **_tokens(tenant_counts.prompt_tokens, tenant_counts.cached_tokens),
                "prefill_seconds_saved": round(tenant_counts.saved_seconds, 3),
                "cost_saved": None if prices is None else round(cost_saved(prices, tenant_counts.cached_tokens), 6),
            }
        )
    return report


def money(prices: ModelPrices | None, stats: EngineStatsSnapshot) -> dict[str, float | None]:
    """Return what the requests cost and what the cache saved at the model's prices; None for both without prices."""
    if prices is None:
        return {"cost": None, "cost_saved": None}
    return {
        "cost": round(cost(prices, stats), 6),
        "cost_saved": round(cost_saved(prices, stats.cached_total), 6),
    }


def _blocks(entries: Sequence[EntryInfo]) -> dict[BlockKey, int]:
    """Return the bytes of each block the entries hold, once per block whatever tiers hold it."""
    return {entry.key: entry.nbytes for entry in entries}


def _tokens(prompt: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "hit_tokens": cached,
        "miss_tokens": prompt - cached,
        "tokens_saved": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
    }


def _depth(key: BlockKey, by_key: dict[BlockKey, list[EntryInfo]], depth: dict[BlockKey, int]) -> int:
    """Return how many present blocks the chain ending at `key` has, remembering every depth on the way."""
    # A loop, not recursion: chains of a long context have thousands of blocks.
    path: list[BlockKey] = []
    current: BlockKey | None = key
    while current is not None and current in by_key and current not in depth:
        path.append(current)
        current = by_key[current][0].parent
    base = depth.get(current, 0) if current is not None else 0
    for step in reversed(path):
        base += 1
        depth[step] = base
    return depth[key]


def _prefix(leaf: BlockKey, by_key: dict[BlockKey, list[EntryInfo]]) -> Prefix:
    tiers: dict[str, int] = defaultdict(int)
    blocks = tokens = 0
    current: BlockKey | None = leaf
    root = leaf
    while current is not None and current in by_key:
        root = current
        blocks += 1
        tokens += by_key[current][0].tokens
        for entry in by_key[current]:
            tiers[entry.tier] += 1
        current = by_key[current][0].parent
    first = by_key[root][0]
    return Prefix(leaf, root, blocks, tokens, by_key[leaf][0].tenant, dict(tiers), complete=first.parent is None)
