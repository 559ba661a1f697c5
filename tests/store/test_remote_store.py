"""The store with a remote tier on a real Redis: two stores on one Redis stand for two replicas, each with its own
folder. What one computes the other finds, in one round trip, verified, promoted into its own tiers; tenants and
models stay apart; deletes and flushes reach Redis; a Redis that goes away costs misses, never errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

from prefixgate.errors import StoreError
from prefixgate.store import RemoteConfig, TieredStore
from prefixgate.store.redis_tier import KEY_PREFIX
from tests.services import RedisClusterNodes, RedisServer
from tests.store.conftest import LAYOUT, FakeClock, config, make_blocks, make_namespace

TOKENS = list(range(4 * LAYOUT.block_size + 1))  # four reusable blocks, and the token that starts generation

ReplicaFactory = Callable[..., TieredStore]


@pytest.fixture
def open_replica(tmp_path: Path, clock: FakeClock) -> Iterator[ReplicaFactory]:
    """Open a store on Redis at `urls` with a folder of its own, as a replica on its own machine would."""
    opened: list[TieredStore] = []

    def factory(urls: tuple[str, ...], **remote: object) -> TieredStore:
        folder = tmp_path / f"replica{len(opened)}"
        store_config = replace(config(), remote=RemoteConfig(urls, **remote))  # type: ignore[arg-type]
        store = TieredStore.open(folder, LAYOUT, store_config, clock=clock)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


def compute(store: TieredStore, tokens: list[int], tenant: str = "", model: str = "model-a") -> list[torch.Tensor]:
    """Store every full block of `tokens` as a replica that computed them would; return their tensors."""
    blocks = make_blocks(store, tokens, make_namespace(tenant, model))
    store.put(blocks)
    store.wait_for_writes()
    return [block.kv for block in blocks]


def test_what_one_replica_computed_another_fetches_verified_and_keeps(
    open_replica: ReplicaFactory, redis_server: RedisServer
) -> None:
    first, second = open_replica((redis_server.url,)), open_replica((redis_server.url,))
    assert first.seed(make_namespace()) == second.seed(make_namespace())  # one secret, shared through Redis
    computed = compute(first, TOKENS)

    assert second.lookup(make_namespace(), TOKENS).tiers == ("remote",) * 4
    hit = second.fetch(make_namespace(), TOKENS)
    assert hit.tiers == ("remote",) * 4
    assert all(torch.equal(got.kv, kv) for got, kv in zip(hit.blocks, computed, strict=True))
    assert second.lookup(make_namespace(), TOKENS).tiers == ("host",) * 4  # promoted, as a disk hit is
    assert second.fetch(make_namespace(), TOKENS).tiers == ("host",) * 4
    remote = second.remote_stats()
    assert remote is not None and (remote.hits, remote.promotions, remote.misses) == (4, 4, 0)
    first_remote = first.remote_stats()
    assert first_remote is not None and first_remote.writes == 4


def test_a_retention_extended_by_a_replica_lengthens_the_blocks_ttl_in_redis(
    open_replica: ReplicaFactory, redis_server: RedisServer
) -> None:
    first, second = open_replica((redis_server.url,), ttl=3600.0), open_replica((redis_server.url,), ttl=3600.0)
    compute(first, TOKENS)
    keys = second.fetch(make_namespace(), TOKENS).keys[:4]
    assert second.retain(keys, 2 * 86_400.0) == 4  # held by the second once promoted; in Redis for every replica
    second.wait_for_writes()
    raw = redis_server.client()
    assert all(86_400_000 < raw.pttl(f"{KEY_PREFIX}{key.hex()}") <= 172_800_000 for key in keys)
    raw.close()


def test_a_chain_partly_local_continues_from_redis(open_replica: ReplicaFactory, redis_server: RedisServer) -> None:
    first, second = open_replica((redis_server.url,)), open_replica((redis_server.url,))
    computed = compute(first, TOKENS)
    compute(second, TOKENS[: 2 * LAYOUT.block_size + 1])  # the second has the first two blocks itself
    hit = second.fetch(make_namespace(), TOKENS)
    assert hit.tiers == ("host", "host", "remote", "remote")
    assert all(torch.equal(got.kv, kv) for got, kv in zip(hit.blocks, computed, strict=True))


def test_the_block_after_a_prefix_is_reused_to_the_token_from_what_another_replica_wrote(
    open_replica: ReplicaFactory, redis_server: RedisServer
) -> None:
    first, second = open_replica((redis_server.url,)), open_replica((redis_server.url,))
    computed = compute(first, TOKENS)
    other = TOKENS[:10] + [999] * 8  # departs in block 2, after two of its four tokens
    hit = second.fetch(make_namespace(), other)
    assert hit.tiers == ("remote", "remote") and hit.cached_tokens == 10
    assert hit.partial is not None and (hit.partial.tier, hit.partial.tokens) == ("remote", 2)
    assert hit.partial_kv is not None and torch.equal(hit.partial_kv, computed[2][:, :, :, :2])
    assert second.fetch(make_namespace("acme"), other).cached_tokens == 0  # another tenant's blocks: none


def test_tenants_and_models_never_share_blocks_in_redis(
    open_replica: ReplicaFactory, redis_server: RedisServer, raw_redis: redis.Redis
) -> None:
    first, second = open_replica((redis_server.url,)), open_replica((redis_server.url,))
    compute(first, TOKENS, tenant="acme")
    assert len(raw_redis.keys(f"{KEY_PREFIX}*")) == 4
    assert second.fetch(make_namespace("globex"), TOKENS).tiers == ()
    assert second.fetch(make_namespace(), TOKENS).tiers == ()  # no tenant is a namespace of its own too
    assert second.fetch(make_namespace("acme", model="model-b"), TOKENS).tiers == ()
    assert second.fetch(make_namespace("acme"), TOKENS).tiers == ("remote",) * 4


def test_deletes_and_flushes_reach_redis_and_only_prefixgate_blocks(
    open_replica: ReplicaFactory, redis_server: RedisServer, raw_redis: redis.Redis
) -> None:
    store = open_replica((redis_server.url,))
    raw_redis.set("app:session", b"theirs")
    compute(store, TOKENS)
    keys = store.reusable_keys(make_namespace(), TOKENS)
    assert store.delete(keys[3]) == 2  # host and disk; Redis too, through its writer
    store.wait_for_writes()
    assert len(raw_redis.keys(f"{KEY_PREFIX}*")) == 3

    assert store.flush("host") == 3 and len(raw_redis.keys(f"{KEY_PREFIX}*")) == 3
    assert store.flush("remote") == 3 and raw_redis.keys(f"{KEY_PREFIX}*") == []
    assert store.lookup(make_namespace(), TOKENS).tiers == ("disk",) * 3
    compute(store, TOKENS)  # only the block new to this store is written to Redis: the others were on its disk
    assert store.flush() == 4 + 4 + 1  # host, disk and Redis
    assert raw_redis.keys(f"{KEY_PREFIX}*") == [] and raw_redis.get("app:session") == b"theirs"
    with pytest.raises(StoreError, match="host, disk, remote"):
        store.flush("redis")


def test_a_stopped_redis_costs_misses_and_the_store_goes_on(
    open_replica: ReplicaFactory, redis_server: RedisServer, clock: FakeClock
) -> None:
    first, second = open_replica((redis_server.url,)), open_replica((redis_server.url,))
    compute(first, TOKENS)
    compute(second, TOKENS[: LAYOUT.block_size + 1])
    redis_server.stop()
    assert second.fetch(make_namespace(), TOKENS).tiers == ("host",)
    assert second.lookup(make_namespace(), TOKENS).tiers == ("host",)  # within the backoff: Redis is not asked
    remote = second.remote_stats()
    assert remote is not None and (remote.available, remote.errors) == (False, 1)
    compute(second, TOKENS)  # computed meanwhile: kept locally, its Redis copy dropped and counted
    assert second.fetch(make_namespace(), TOKENS).tiers == ("host",) * 4
    remote = second.remote_stats()
    assert remote is not None and remote.dropped_writes == 3
    assert second.remote_usage() is None

    redis_server.start()  # on the same port, empty: the shared secret is gone too
    clock.advance(60.0)  # the backoff is over
    later = [t + 1 for t in TOKENS]
    assert second.lookup(make_namespace(), later).tiers == ()  # Redis answers: the second puts the secret back
    third = open_replica((redis_server.url,))  # a replica started now keys blocks as the running ones do
    assert third.seed(make_namespace()) == second.seed(make_namespace())
    compute(second, later)
    remote = second.remote_stats()
    assert remote is not None and remote.available and remote.writes == 1 + 4  # its first block, and these
    # The first never saw Redis go: its client finds its connection closed by the old process, and opens another.
    assert first.fetch(make_namespace(), later).tiers == ("remote",) * 4


def test_a_store_cannot_open_on_a_redis_that_does_not_answer(tmp_path: Path, redis_server: RedisServer) -> None:
    url = redis_server.url
    redis_server.stop()
    store_config = replace(config(), remote=RemoteConfig((url,)))
    with pytest.raises(StoreError, match="shared secret"):
        TieredStore.open(tmp_path, LAYOUT, store_config)


def test_blocks_spread_over_a_redis_cluster_and_are_found_again(
    open_replica: ReplicaFactory, redis_cluster: RedisClusterNodes
) -> None:
    first, second = open_replica(redis_cluster.urls), open_replica(redis_cluster.urls[1:])
    prompts = [[prompt * 1000 + t for t in TOKENS] for prompt in range(6)]
    computed = [compute(first, tokens) for tokens in prompts]
    held = [node.client().dbsize() for node in redis_cluster.nodes]
    # 24 blocks, the lists of what follows 18 of them (a prompt's first three), and the secret, on every node.
    assert sum(held) == 6 * 4 + 6 * 3 + 1 and all(held)
    for tokens, kvs in zip(prompts, computed, strict=True):
        hit = second.fetch(make_namespace(), tokens)
        assert hit.tiers == ("remote",) * 4
        assert all(torch.equal(got.kv, kv) for got, kv in zip(hit.blocks, kvs, strict=True))
    assert second.flush("remote") == 24
    assert [node.client().dbsize() for node in redis_cluster.nodes].count(0) == 2  # the secret stays
