"""The Redis tier against a real redis-server: chain reads in one round trip, verification, TTLs, a flush that
touches only prefixgate's keys, a dead Redis answered with misses and retried with backoff, a bounded writer,
Redis out of memory, and the shared secret."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

from prefixgate.errors import ConfigError, StoreError
from prefixgate.store import Block, BlockKey, chain_keys
from prefixgate.store.redis_tier import KEY_PREFIX, SECRET_KEY, RedisTier, masked_url
from tests.store.conftest import BLOCK, LAYOUT, FakeClock, make_kv, make_namespace

PASSWORD = "test-password-5d1e"  # the server requires it, so every test goes through credentials in the URL
REDIS_SERVER = shutil.which("redis-server")

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


class RedisServer:
    """A real redis-server on a free port, with no persistence, that a test may stop and start again on that port."""

    def __init__(self, folder: Path) -> None:
        assert REDIS_SERVER is not None
        self.folder = folder
        self.port = _free_port()
        self.url = f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and return once it answers PING."""
        assert REDIS_SERVER is not None and self._process is None
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        try:
            for _ in range(400):  # it answers within milliseconds; the bound only stops a broken start hanging
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self._process.poll() is not None:
                        raise RuntimeError(f"redis-server exited with {self._process.returncode}") from None
                    time.sleep(0.025)
            raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the server, if it runs; everything it held is gone."""
        if self._process is None:
            return
        self._process.terminate()
        self._process.wait(timeout=30)
        self._process = None

    def client(self) -> redis.Redis:
        """Return a plain client, for what a test does to Redis behind the tier's back."""
        return redis.Redis.from_url(self.url)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    running = RedisServer(tmp_path)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def raw(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client()
    yield client
    client.close()


@pytest.fixture
def open_tier(server: RedisServer, clock: FakeClock) -> Iterator[TierFactory]:
    """Open tiers on the test's server and clock, closing them after the test."""
    opened: list[RedisTier] = []

    def factory(**settings: Any) -> RedisTier:
        tier = RedisTier(server.url, LAYOUT, clock=clock, **settings)
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
    found = reader.get_chain(keys_of(blocks), tokens_of(blocks), out)
    assert [got.block.key for got in found] == keys_of(blocks)
    for index, (got, block) in enumerate(zip(found, blocks, strict=True)):
        assert torch.equal(got.block.kv, block.kv)
        assert (got.block.tokens, got.block.parent, got.block.created) == (block.tokens, block.parent, block.created)
        assert (got.pinned, got.ttl) == (False, None)
        slot = out[:, :, :, index * size : (index + 1) * size]
        assert got.block.kv.data_ptr() == slot.data_ptr() and torch.equal(slot, block.kv)  # copied into place
    assert not out[:, :, :, 3 * size :].any()
    standalone = reader.get_chain(keys_of(blocks), tokens_of(blocks))
    assert [torch.equal(got.block.kv, block.kv) for got, block in zip(standalone, blocks, strict=True)] == [True] * 3
    stats = reader.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (6, 0, 0, 0)
    assert writer.stats().writes == 3 and writer.stats().bytes_written > 3 * BLOCK


def test_a_chain_is_read_in_one_round_trip(open_tier: TierFactory, raw: redis.Redis, clock: FakeClock) -> None:
    writer, reader = open_tier(), open_tier()
    blocks = make_chain(6, clock.now)
    write(writer, blocks[:5])  # the last is missing: the read asks for it too, in the same command
    assert len(reader.get_chain(keys_of(blocks[:1]), tokens_of(blocks[:1]))) == 1  # opens the reader's connection
    raw.config_resetstat()
    assert len(reader.get_chain(keys_of(blocks), tokens_of(blocks))) == 5
    calls = {
        name: stats["calls"]
        for name, stats in raw.info("commandstats").items()
        if not name.startswith(("cmdstat_config", "cmdstat_info"))  # this test's own: CONFIG RESETSTAT, INFO
    }
    assert calls == {"cmdstat_mget": 1}
    assert raw.info("stats")["keyspace_hits"] == 5


def test_a_chain_read_ends_at_the_first_missing_block_and_counts_one_miss(
    open_tier: TierFactory, clock: FakeClock
) -> None:
    tier = open_tier()
    blocks = make_chain(4, clock.now)
    write(tier, blocks[:2] + blocks[3:])
    found = tier.get_chain(keys_of(blocks), tokens_of(blocks))
    assert [got.block.key for got in found] == keys_of(blocks[:2])
    assert (tier.counters.hits, tier.counters.misses) == (2, 1)


@pytest.mark.parametrize("damage", ["a flipped payload byte", "another block's value"])
def test_a_value_that_fails_verification_is_a_miss_counted_corrupt_and_deleted(
    damage: str, open_tier: TierFactory, raw: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    blocks = make_chain(3, clock.now)
    write(tier, blocks)
    value = raw.get(redis_key(blocks[0] if damage == "another block's value" else blocks[1]))
    assert isinstance(value, bytes)
    damaged = bytearray(value)
    if damage == "a flipped payload byte":
        damaged[-1] ^= 0xFF
    raw.set(redis_key(blocks[1]), bytes(damaged), keepttl=True)
    found = tier.get_chain(keys_of(blocks), tokens_of(blocks))
    assert [got.block.key for got in found] == keys_of(blocks[:1])
    assert (tier.counters.corrupt, tier.counters.hits, tier.counters.misses) == (1, 1, 1)
    tier.flush()  # the delete goes through the writer
    assert [raw.exists(redis_key(block)) for block in blocks] == [1, 0, 1]


# -- writing --------------------------------------------------------------------------------------------------------


def test_every_block_expires_by_the_tiers_ttl_or_its_own_when_sooner(
    open_tier: TierFactory, raw: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier(ttl=3600.0)
    plain, short, over = make_chain(3, clock.now)
    assert tier.put(plain) and tier.put(short, ttl=60.0)
    tier.flush()
    assert 60_000 < raw.pttl(redis_key(plain)) <= 3_600_000
    assert 0 < raw.pttl(redis_key(short)) <= 60_000
    clock.advance(30.0)
    assert not tier.put(over, ttl=20.0)  # its own lifetime ended 10 s ago
    tier.flush()
    assert raw.exists(redis_key(over)) == 0
    assert tier.counters.dropped_writes == 0  # not a drop: there was nothing left to keep


def test_clear_deletes_every_prefixgate_block_and_nothing_else(
    open_tier: TierFactory, raw: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    secret = tier.load_or_create_secret()
    raw.set("app:session", b"theirs")
    blocks = make_chain(1_100, clock.now)  # more than one SCAN step and one UNLINK batch
    write(tier, blocks[:1_000])
    assert tier.count_entries() == 1_000
    for block in blocks[1_000:]:
        assert tier.put(block)  # still queued when the clear begins: the clear sends and then deletes them
    assert tier.clear() == 1_100
    assert raw.keys(f"{KEY_PREFIX}*") == []
    assert raw.get("app:session") == b"theirs" and raw.get(SECRET_KEY) == secret
    assert tier.count_entries() == 0


def test_a_writer_too_far_behind_drops_further_blocks_and_counts_them(
    open_tier: TierFactory, raw: redis.Redis, clock: FakeClock
) -> None:
    # Redis holds back every write command until the test lets it go, so the writer sends nothing meanwhile. The
    # long timeout is not waited for: it only bounds a run in which the pause is never lifted.
    tier = open_tier(queue_bytes=2 * BLOCK, write_timeout=60.0)
    blocks = make_chain(4, clock.now)
    raw.client_pause(60_000, all=False)  # WRITE mode: reads and this client's own commands still run
    try:
        assert [tier.put(block) for block in blocks] == [True, True, False, False]
        assert tier.stats().queued_bytes == 2 * BLOCK
    finally:
        raw.client_unpause()
    tier.flush()
    assert [raw.exists(redis_key(block)) for block in blocks] == [1, 1, 0, 0]
    assert tier.counters.dropped_writes == 2
    assert tier.put(blocks[2])  # the writer caught up: room again
    tier.flush()
    assert raw.exists(redis_key(blocks[2])) == 1 and tier.stats().queued_bytes == 0


def test_a_write_redis_refuses_for_lack_of_memory_is_dropped_and_counted(
    open_tier: TierFactory, raw: redis.Redis, clock: FakeClock
) -> None:
    tier = open_tier()
    refused, taken = make_chain(2, clock.now)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", 1)  # already over it: every write is refused with OOM
    assert tier.put(refused)  # taken by the writer; Redis refuses it
    tier.flush()
    assert raw.exists(redis_key(refused)) == 0
    assert (tier.counters.dropped_writes, tier.counters.errors, tier.counters.writes) == (1, 0, 0)
    assert tier.available  # Redis answered: full is not down
    raw.config_set("maxmemory", 0)
    write(tier, [taken])
    assert raw.exists(redis_key(taken)) == 1 and tier.counters.writes == 1


# -- faults ---------------------------------------------------------------------------------------------------------


def test_a_stopped_redis_answers_misses_and_the_tier_serves_again_after_its_backoff(
    open_tier: TierFactory, server: RedisServer, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate.store.redis_tier")
    tier = open_tier(backoff=1.0, max_backoff=60.0)
    blocks = make_chain(2, clock.now)
    keys, tokens = keys_of(blocks), tokens_of(blocks)
    write(tier, blocks)
    assert len(tier.get_chain(keys, tokens)) == 2

    server.stop()
    assert tier.get_chain(keys, tokens) == []
    assert (tier.counters.errors, tier.counters.misses, tier.available) == (1, 1, False)
    assert not tier.put(blocks[0])  # not queued for a Redis that is down
    assert tier.counters.dropped_writes == 1
    assert tier.count_entries() is None
    clock.advance(1.0)  # the first backoff is over: the next read tries Redis, fails, and doubles the backoff
    assert tier.get_chain(keys, tokens) == []
    assert tier.counters.errors == 2
    clock.advance(1.0)
    assert tier.get_chain(keys, tokens) == []
    assert tier.counters.errors == 2  # within the backoff: Redis is not asked

    server.start()  # on the same port, empty
    assert tier.get_chain(keys, tokens) == [] and tier.counters.errors == 2  # still within the backoff
    clock.advance(1.0)
    assert tier.get_chain(keys, tokens) == []  # Redis answers: nothing there after the restart
    assert tier.available and tier.counters.errors == 2
    write(tier, blocks)
    assert [got.block.key for got in tier.get_chain(keys, tokens)] == keys

    assert "answers again" in caplog.text and masked_url(server.url) in caplog.text
    assert PASSWORD not in caplog.text


def test_the_secret_cannot_be_read_from_a_stopped_redis(open_tier: TierFactory, server: RedisServer) -> None:
    tier = open_tier()
    server.stop()
    with pytest.raises(StoreError, match="shared secret") as raised:
        tier.load_or_create_secret()
    assert PASSWORD not in str(raised.value)


# -- the shared secret and the URL -------------------------------------------------------------------------------


def test_replicas_starting_at_once_create_one_secret_and_all_read_it(open_tier: TierFactory, raw: redis.Redis) -> None:
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
    assert len(secrets) == 8 and set(secrets) == {raw.get(SECRET_KEY)}
    assert len(secrets[0]) == 32
    assert tiers[0].load_or_create_secret() == secrets[0]  # and later calls read the same
    assert raw.ttl(SECRET_KEY) == -1  # never expires, so a `volatile-*` eviction policy never evicts it


def test_a_damaged_secret_is_an_error_that_says_how_to_reset_it(open_tier: TierFactory, raw: redis.Redis) -> None:
    raw.set(SECRET_KEY, b"short")
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
    tier = RedisTier(url, LAYOUT)  # connects only when first used
    try:
        assert tier.stats().url == shown and "hunter2" not in repr(tier)
    finally:
        tier.close()


def test_a_url_of_another_scheme_is_a_config_error_that_hides_the_password() -> None:
    with pytest.raises(ConfigError, match=r"redis://") as raised:
        RedisTier("http://:hunter2@cache:6379/0", LAYOUT)
    assert "hunter2" not in str(raised.value)
