"""The Redis tier against a real redis-server: chain reads in one round trip, verification, TTLs, a flush that
touches only prefixgate's keys, a dead Redis answered with misses and retried with backoff, a bounded writer,
Redis out of memory, and the shared secret."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis
import torch

from prefixgate.errors import ConfigError, StoreError
from prefixgate.store import Block, BlockKey, Keep, chain_keys, redis_tier, tail_key
from prefixgate.store.codec import encode
from prefixgate.store.redis_tier import KEY_PREFIX, SECRET_KEY, RedisTier
from prefixgate.urls import masked_url
from tests.services import PASSWORD, RedisClusterNodes, RedisServer
from tests.store.conftest import BLOCK, LAYOUT, FakeClock, make_kv, make_namespace

TierFactory = Callable[..., RedisTier]


def make_chain(count: int, created: float, start: int = 0) -> list[Block]:
    """Return `count` chained blocks of distinct tokens, created at `created`."""
    size = LAYOUT.block_size
    tokens = list(range(start, start + count * size))
    keys = chain_keys(make_namespace().seed(bytes(32)), tokens, size)
    return [
        Block(
            key,
            tuple(tokens[i * size : (i + 1) * size]),
            make_kv(start + i),
            parent=keys[i - 1] if i else None,
            created=created,
        )
        for i, key in enumerate(keys)
    ]


def keys_of(blocks: Sequence[Block]) -> list[BlockKey]:
    return [block.key for block in blocks]


def tokens_of(blocks: Sequence[Block]) -> list[int]:
    return [token for block in blocks for token in block.tokens]


def redis_key(block: Block) -> str:
    return f"{KEY_PREFIX}{block.key.hex()}"


def write(tier: RedisTier, blocks: Sequence[Block]) -> None:
    """Put every block and wait until the writer has sent them."""
    assert all(tier.put(block) for block in blocks)
    tier.flush()


@pytest.fixture
def open_tier(redis_server: RedisServer, clock: FakeClock) -> Iterator[TierFactory]:
    """Open tiers on the test's server and clock, closing them after the test."""
    opened: list[RedisTier] = []

    def factory(**settings: Any) -> RedisTier:
        tier = RedisTier((redis_server.url,), LAYOUT, clock=clock, **settings)
        opened.append(tier)
        return tier

    yield factory
    for tier in opened:
        tier.close()


# -- reading --------------------------------------------------------------------------------------------------------


def test_blocks_one_tier_writes_are_read_whole_by_another_on_the_same_url(
    open_tier: TierFactory, clock: FakeClock
) -> None:
    writer, reader = open_tier(), open_tier()
    blocks = make_chain(3, clock.now)
    write(writer, blocks)
    layers, two, heads, size, head_dim = LAYOUT.shape
    out = torch.zeros((layers, two, heads, 4 * size, head_dim), dtype=LAYOUT.dtype)  # out: one block to spare
    found = reader.get_chain(keys_of(blocks), tokens_of(blocks), out).blocks
    assert [got.block.key for got in found] == keys_of(blocks)
    for index, (got, block) in enumerate(zip(found, blocks, strict=True)):
        assert torch.equal(got.block.kv, block.kv)
        assert (got.block.tokens, got.block.parent, got.block.created) == (block.tokens, block.parent, block.created)
        assert got.keep == Keep()
        slot = out[:, :, :, index * size : (index + 1) * size]
        assert got.block.kv.data_ptr() == slot.data_ptr() and torch.equal(slot, block.kv)  # copied into place
    assert not out[:, :, :, 3 * size :].any()
    standalone = reader.get_chain(keys_of(blocks), tokens_of(blocks)).blocks
    assert [torch.equal(got.block.kv, block.kv) for got, block in zip(standalone, blocks, strict=True)] == [True] * 3
    stats = reader.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (6, 0, 0, 0)
    assert writer.stats().writes == 3 and writer.stats().written_bytes > 3 * BLOCK


def test_a_chain_and_what_follows_it_are_read_and_looked_up_in_one_round_trip_each(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    writer, reader = open_tier(), open_tier()
    blocks = make_chain(6, clock.now)
    tail = Block(tail_key(blocks[4].key, (7, 7)), (7, 7), make_kv(5), parent=blocks[4].key, created=clock.now)
    write(writer, [*blocks[:5], tail])  # the last block is missing: the read asks for it too, in the same round trip
    assert len(reader.get_chain(keys_of(blocks[:1]), tokens_of(blocks[:1])).blocks) == 1  # opens its connection
    following = [(tail.key, tail.tokens)]  # listed after the run's last block
    for read, found in (
        (lambda: reader.get_chain(keys_of(blocks), tokens_of(blocks)), (5, following)),
        (lambda: reader.present(keys_of(blocks)), (5, following)),
        (lambda: reader.present(keys_of(blocks[1:]), parent=blocks[0].key), (4, following)),
    ):
        raw_redis.config_resetstat()
        run = read()
        assert (run.run, run.following) == found
        # The server counts each time it reads from a client: the test's own INFO is one, the tier's pipeline one.
        assert raw_redis.info("stats")["total_reads_processed"] == 2
    calls = {
        name: stats["calls"]
        for name, stats in raw_redis.info("commandstats").items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))  # this test's own: CONFIG RESETSTAT, INFO
    }
    assert calls == {"cmdstat_exists": 5, "cmdstat_lrange": 6}  # the lookup reads no block


def test_a_long_chain_streams_with_a_bounded_look_ahead_in_one_round_trip_and_stops_at_a_gap(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_tier, "_AHEAD_BYTES", 2 * BLOCK)  # two blocks asked for beyond the one read
    writer, reader = open_tier(), open_tier()
    blocks = make_chain(12, clock.now)
    write(writer, blocks[:5])
    raw_redis.config_resetstat()
    found = reader.get_chain(keys_of(blocks), tokens_of(blocks)).blocks
    assert [got.block.key for got in found] == keys_of(blocks[:5])
    # Blocks 0-1 first, then one more as each arrives, up to the gap at 5: 6 and 7 were on their way, 8-11 never
    # asked for. Their replies are drained, so the connection serves the next read.
    assert raw_redis.info("commandstats")["cmdstat_get"]["calls"] == 8
    assert reader.counters.round_trips == 1
    again = reader.get_chain(keys_of(blocks), tokens_of(blocks)).blocks
    assert [torch.equal(got.block.kv, block.kv) for got, block in zip(again, blocks, strict=False)] == [True] * 5
    assert (reader.counters.round_trips, reader.counters.errors) == (2, 0)


def test_a_chain_read_ends_at_the_first_missing_block_and_counts_one_miss(
    open_tier: TierFactory, clock: FakeClock
) -> None:
    tier = open_tier()
    blocks = make_chain(4, clock.now)
    write(tier, blocks[:2] + blocks[3:])
    found = tier.get_chain(keys_of(blocks), tokens_of(blocks)).blocks
    assert [got.block.key for got in found] == keys_of(blocks[:2])
    assert (tier.counters.hits, tier.counters.misses) == (2, 1)


@pytest.mark.parametrize(
    ("stored", "corrupt"),
    [
        ("a flipped payload byte", True),
        ("another block's value", True),
        ("a larger value", True),  # read through and dropped, never held whole: a block's value has a known size
        ("a list", False),  # an error reply (WRONGTYPE) in place of a value: a miss, but not the tier's to delete
    ],
)
def test_a_value_that_fails_verification_is_a_miss_counted_corrupt_and_deleted(
    stored: str, corrupt: bool, open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    blocks = make_chain(3, clock.now)
    write(tier, blocks)
    key = redis_key(blocks[1])
    value = raw_redis.get(redis_key(blocks[0] if stored == "another block's value" else blocks[1]))
    assert isinstance(value, bytes)
    damaged = bytearray(value)
    if stored == "a flipped payload byte":
        damaged[-1] ^= 0xFF
    elif stored == "a larger value":
        damaged = bytearray(BLOCK + (1 << 20))
    raw_redis.set(key, bytes(damaged), keepttl=True)
    if stored == "a list":
        raw_redis.delete(key)
        raw_redis.rpush(key, b"x")
    found = tier.get_chain(keys_of(blocks), tokens_of(blocks)).blocks
    assert [got.block.key for got in found] == keys_of(blocks[:1])
    counters = tier.counters
    assert (counters.corrupt, counters.hits, counters.misses, counters.errors) == (int(corrupt), 1, 1, 0)
    tier.flush()  # the delete goes through the writer
    assert [raw_redis.exists(redis_key(block)) for block in blocks] == [1, int(not corrupt), 1]
    write(tier, blocks[1:2])  # the connection reads on: the stream stayed in step
    assert len(tier.get_chain(keys_of(blocks), tokens_of(blocks)).blocks) == 3


def test_reads_speak_resp3_when_the_url_asks_for_it(redis_server: RedisServer, clock: FakeClock) -> None:
    tier = RedisTier((f"{redis_server.url}?protocol=3",), LAYOUT, clock=clock)
    try:
        blocks = make_chain(3, clock.now)
        write(tier, blocks[:2])
        run = tier.get_chain(keys_of(blocks), tokens_of(blocks))  # RESP3 answers the missing third with its null
        assert (run.run, run.following) == (2, [])
        assert tier.present(keys_of(blocks)).run == 2 and tier.continuations(blocks[0].key) == [
            (blocks[1].key, blocks[1].tokens)
        ]
        assert tier.counters.errors == 0
    finally:
        tier.close()


def test_a_read_answered_moved_by_a_cluster_node_finds_the_block_on_its_new_node_next_time(
    redis_cluster: RedisClusterNodes, clock: FakeClock
) -> None:
    tier = RedisTier(redis_cluster.urls, LAYOUT, clock=clock)
    try:
        blocks = make_chain(1, clock.now)
        key = redis_key(blocks[0])
        clients = [node.client() for node in redis_cluster.nodes]
        slot = clients[0].cluster("KEYSLOT", key)
        target = next(client for client in clients if not _serves(client, slot))
        # The slot moves (empty, so no keys migrate) after the tier learned the map of slots; the block goes there.
        target_id = target.cluster("MYID")
        for client in (target, *(client for client in clients if client is not target)):
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        target.set(key, encode(blocks[0]))
        assert tier.get_chain(keys_of(blocks), tokens_of(blocks)).run == 0  # the old node answers MOVED: a miss
        assert tier.get_chain(keys_of(blocks), tokens_of(blocks)).run == 1  # the map read again: found
        assert tier.counters.errors == 0
    finally:
        tier.close()


def test_a_stopped_cluster_node_costs_misses_and_errors_and_never_fails_a_read(
    redis_cluster: RedisClusterNodes, clock: FakeClock
) -> None:
    tier = RedisTier(redis_cluster.urls, LAYOUT, clock=clock, backoff=1.0)
    try:
        blocks = make_chain(12, clock.now)  # spread over the three nodes
        write(tier, blocks)
        assert tier.get_chain(keys_of(blocks), tokens_of(blocks)).run == 12
        redis_cluster.nodes[1].stop()
        for _ in range(3):  # the map of slots is read again after each fault: the other nodes still list the node
            assert tier.get_chain(keys_of(blocks), tokens_of(blocks)).run < 12
            clock.advance(60.0)
        assert tier.counters.errors == 3 and not tier.available
    finally:
        tier.close()


def _serves(client: redis.Redis, slot: int) -> bool:
    """Return whether the cluster node behind `client` serves `slot`."""
    myself = client.cluster("MYID")
    ranges = client.execute_command("CLUSTER", "SLOTS")  # [start, end, [host, port, node id], ...replicas]
    return any(start <= slot <= end and primary[2] == myself for start, end, primary, *_ in ranges)


# -- writing --------------------------------------------------------------------------------------------------------


def test_every_block_expires_by_the_tiers_ttl_or_its_own_when_sooner(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier(ttl=3600.0)
    plain, short, over = make_chain(3, clock.now)
    assert tier.put(plain) and tier.put(short, Keep(ttl=60.0))
    tier.flush()
    assert 60_000 < raw_redis.pttl(redis_key(plain)) <= 3_600_000
    assert 0 < raw_redis.pttl(redis_key(short)) <= 60_000
    clock.advance(30.0)
    assert not tier.put(over, Keep(ttl=20.0))  # its own lifetime ended 10 s ago
    tier.flush()
    assert raw_redis.exists(redis_key(over)) == 0
    assert tier.counters.dropped_writes == 0  # not a drop: there was nothing left to keep


def test_a_retained_block_lives_in_redis_at_least_until_its_retention_ends(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier(ttl=60.0)
    (block,) = make_chain(1, clock.now)
    assert tier.put(block, Keep(ttl=30.0, retain_until=clock.now + 7200.0))
    tier.flush()
    assert 3_600_000 < raw_redis.pttl(redis_key(block)) <= 7_200_000
    (found,) = tier.get_chain([block.key], block.tokens).blocks
    assert found.keep == Keep(ttl=30.0, retain_until=clock.now + 7200.0)


def test_a_later_retention_lengthens_a_blocks_ttl_in_redis_and_never_shortens_it(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier(ttl=60.0)
    kept, gone = make_chain(2, clock.now)
    write(tier, [kept])
    tier.retain([kept.key, gone.key], clock.now + 86_400.0)  # one Redis does not hold: not brought back
    tier.flush()
    assert 3_600_000 < raw_redis.pttl(redis_key(kept)) <= 86_400_000
    tier.retain([kept.key], clock.now + 600.0)  # shorter than the TTL it has now: left as it is
    tier.flush()
    assert raw_redis.pttl(redis_key(kept)) > 3_600_000 and raw_redis.exists(redis_key(gone)) == 0
    assert tier.counters.errors == 0


def test_blocks_written_after_a_block_are_listed_with_their_tokens_and_cleared_with_the_blocks(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    blocks = make_chain(3, clock.now)
    tail = Block(tail_key(blocks[1].key, (7, 7)), (7, 7), make_kv(5), parent=blocks[1].key, created=clock.now)
    write(tier, [*blocks, tail])
    assert tier.continuations(blocks[1].key) == [(blocks[2].key, blocks[2].tokens), (tail.key, (7, 7))]
    assert tier.continuations(blocks[2].key) == []
    got = tier.get_block(tail.key, (7,))
    assert got is not None and got.tokens == (7, 7) and torch.equal(got.kv, tail.kv)
    assert tier.get_block(blocks[2].key, (9,)) is None and tier.counters.corrupt == 1  # not the tokens listed
    assert tier.clear() == 3  # the blocks left; the lists of what follows them go too
    assert raw_redis.keys("prefixgate:*") == []


def test_clear_deletes_every_prefixgate_block_and_nothing_else(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    secret = tier.load_or_create_secret()
    raw_redis.set("app:session", b"theirs")
    blocks = make_chain(1_100, clock.now)  # more than one SCAN step and one UNLINK batch
    write(tier, blocks[:1_000])
    usage = tier.usage()
    assert usage is not None and usage.entries == 1_000 and usage.used_memory > 1_000 * BLOCK
    for block in blocks[1_000:]:
        assert tier.put(block)  # still queued when the clear begins: the clear sends and then deletes them
    assert tier.clear() == 1_100
    assert raw_redis.keys(f"{KEY_PREFIX}*") == []
    assert raw_redis.get("app:session") == b"theirs" and raw_redis.get(SECRET_KEY) == secret
    usage = tier.usage()
    assert usage is not None and usage.entries == 0


def test_a_writer_too_far_behind_drops_further_blocks_and_counts_them(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    # Redis holds back every write command until the test lets it go, so the writer sends nothing meanwhile. The
    # long timeout is not waited for: it only bounds a run in which the pause is never lifted.
    tier = open_tier(queue_bytes=2 * BLOCK, write_timeout=60.0)
    blocks = make_chain(4, clock.now)
    raw_redis.client_pause(60_000, all=False)  # WRITE mode: reads and this client's own commands still run
    try:
        assert [tier.put(block) for block in blocks] == [True, True, False, False]
        assert tier.stats().queued_bytes == 2 * BLOCK
    finally:
        raw_redis.client_unpause()
    tier.flush()
    assert [raw_redis.exists(redis_key(block)) for block in blocks] == [1, 1, 0, 0]
    assert tier.counters.dropped_writes == 2
    assert tier.put(blocks[2])  # the writer caught up: room again
    tier.flush()
    assert raw_redis.exists(redis_key(blocks[2])) == 1 and tier.stats().queued_bytes == 0


def test_a_write_redis_refuses_for_lack_of_memory_is_dropped_and_counted(
    open_tier: TierFactory, raw_redis: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    refused, taken = make_chain(2, clock.now)
    raw_redis.config_set("maxmemory-policy", "noeviction")
    raw_redis.config_set("maxmemory", 1)  # already over it: every write is refused with OOM
    assert tier.put(refused)  # taken by the writer; Redis refuses it
    tier.flush()
    assert raw_redis.exists(redis_key(refused)) == 0
    assert (tier.counters.dropped_writes, tier.counters.errors, tier.counters.writes) == (1, 0, 0)
    assert tier.available  # Redis answered: full is not down
    raw_redis.config_set("maxmemory", 0)
    write(tier, [taken])
    assert raw_redis.exists(redis_key(taken)) == 1 and tier.counters.writes == 1


# -- faults ---------------------------------------------------------------------------------------------------------


def test_a_stopped_redis_answers_misses_and_the_tier_serves_again_after_its_backoff(
    open_tier: TierFactory, redis_server: RedisServer, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.store.redis_tier")
    tier = open_tier(backoff=1.0, max_backoff=60.0)
    blocks = make_chain(2, clock.now)
    keys, tokens = keys_of(blocks), tokens_of(blocks)
    write(tier, blocks)
    assert len(tier.get_chain(keys, tokens).blocks) == 2

    redis_server.stop()
    assert tier.get_chain(keys, tokens).blocks == []
    assert (tier.counters.errors, tier.counters.misses, tier.available) == (1, 1, False)
    assert not tier.put(blocks[0])  # not queued for a Redis that is down
    assert tier.counters.dropped_writes == 1
    assert tier.usage() is None
    clock.advance(1.0)  # the first backoff is over: the next read tries Redis, fails, and doubles the backoff
    assert tier.get_chain(keys, tokens).blocks == []
    assert tier.counters.errors == 2
    clock.advance(1.0)
    assert tier.get_chain(keys, tokens).blocks == []
    assert tier.counters.errors == 2  # within the backoff: Redis is not asked

    redis_server.start()  # on the same port, empty
    assert tier.get_chain(keys, tokens).blocks == [] and tier.counters.errors == 2  # still within the backoff
    clock.advance(1.0)
    assert tier.get_chain(keys, tokens).blocks == []  # Redis answers: nothing there after the restart
    assert tier.available and tier.counters.errors == 2
    write(tier, blocks)
    assert [got.block.key for got in tier.get_chain(keys, tokens).blocks] == keys

    assert "answers again" in caplog.text and masked_url(redis_server.url) in caplog.text
    assert PASSWORD not in caplog.text


def test_a_redis_that_stops_answering_mid_read_costs_the_read_its_timeout_and_a_miss(
    open_tier: TierFactory, redis_server: RedisServer, clock: FakeClock
) -> None:
    tier = open_tier(socket_timeout=0.1, backoff=1.0)
    blocks = make_chain(3, clock.now)
    keys, tokens = keys_of(blocks), tokens_of(blocks)
    write(tier, blocks)
    redis_server.freeze()  # Redis takes the commands into its socket and answers none
    try:
        assert tier.get_chain(keys, tokens).run == 0
    finally:
        redis_server.thaw()  # it now answers the timed-out read, on a connection the tier has dropped
    assert (tier.counters.errors, tier.counters.misses, tier.available) == (1, 1, False)
    clock.advance(1.0)
    # Another read, on another connection: the timed-out one, whose late replies would answer this read's commands
    # with the blocks of the last one, was dropped.
    assert tier.get_chain(keys[1:], tokens[LAYOUT.block_size :], parent=keys[0]).run == 2
    assert tier.available and (tier.counters.errors, tier.counters.corrupt) == (1, 0)


def test_a_health_check_asks_redis_unless_within_the_backoff(
    open_tier: TierFactory, redis_server: RedisServer, clock: FakeClock
) -> None:
    tier = open_tier(backoff=1.0)
    assert tier.check() and tier.available
    redis_server.stop()
    assert not tier.check() and tier.counters.errors == 1
    assert not tier.check() and tier.counters.errors == 1  # within the backoff: not asked
    redis_server.start()
    clock.advance(1.0)
    assert tier.check() and tier.available


def test_the_secret_cannot_be_read_from_a_stopped_redis(open_tier: TierFactory, redis_server: RedisServer) -> None:
    tier = open_tier()
    redis_server.stop()
    with pytest.raises(StoreError, match="shared secret") as raised:
        tier.load_or_create_secret()
    assert PASSWORD not in str(raised.value)


# -- the shared secret and the URL -------------------------------------------------------------------------------


def test_replicas_starting_at_once_create_one_secret_and_all_read_it(
    open_tier: TierFactory, raw_redis: redis.Redis
) -> None:
    tiers = [open_tier() for _ in range(8)]
    start = threading.Barrier(len(tiers))
    secrets: list[bytes] = []

    def replica(tier: RedisTier) -> None:
        start.wait()
        secrets.append(tier.load_or_create_secret())

    threads = [threading.Thread(target=replica, args=(tier,)) for tier in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(secrets) == 8 and set(secrets) == {raw_redis.get(SECRET_KEY)}
    assert len(secrets[0]) == 32
    assert tiers[0].load_or_create_secret() == secrets[0]  # and later calls read the same
    assert raw_redis.ttl(SECRET_KEY) == -1  # never expires, so a `volatile-*` eviction policy never evicts it


def test_a_health_check_puts_a_lost_secret_back_and_logs_one_replaced(
    open_tier: TierFactory, raw_redis: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_tier()
    secret = tier.load_or_create_secret()
    raw_redis.flushall()  # as a Redis restarted without persistence
    assert tier.check() and raw_redis.get(SECRET_KEY) == secret
    raw_redis.set(SECRET_KEY, bytes(32))
    assert tier.check() and tier.check()
    assert caplog.text.count("holds another shared secret") == 1 and raw_redis.get(SECRET_KEY) == bytes(32)


def test_a_damaged_secret_is_an_error_that_says_how_to_reset_it(open_tier: TierFactory, raw_redis: redis.Redis) -> None:
    raw_redis.set(SECRET_KEY, b"short")
    with pytest.raises(StoreError, match="delete it to reset"):
        open_tier().load_or_create_secret()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://prefixgate:hunter2@cache.example:6380/2", "rediss://prefixgate:***@cache.example:6380/2"),
        (
            "redis://cache/0?password=hunter2&health_check_interval=30",
            "redis://cache/0?password=***&health_check_interval=30",
        ),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_urls_are_shown_with_their_password_masked(url: str, shown: str) -> None:
    assert masked_url(url) == shown
    tier = RedisTier((url,), LAYOUT)  # connects only when first used
    try:
        assert tier.stats().url == shown and "hunter2" not in repr(tier)
    finally:
        tier.close()


def test_a_url_of_another_scheme_is_a_config_error_that_hides_the_password() -> None:
    with pytest.raises(ConfigError, match=r"redis://") as raised:
        RedisTier(("http://:hunter2@cache:6379/0",), LAYOUT)
    assert "hunter2" not in str(raised.value)
