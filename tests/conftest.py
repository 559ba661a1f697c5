"""Fixtures every test folder may use: real Redis services on free local ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.services import REDIS_CLI, REDIS_SERVER, RedisClusterNodes, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that requires a password, for this test alone."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    folder = tmp_path / "redis"
    folder.mkdir()
    running = RedisServer(folder)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def raw_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client of the test's Redis, for what a test does behind prefixgate's back."""
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A three-node Redis Cluster, for this test alone."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server and redis-cli are not installed (apt-get install redis-server redis-tools)")
    cluster = RedisClusterNodes(tmp_path / "cluster")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
