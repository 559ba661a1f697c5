"""The proxy with a remote tier on a real Redis, in this process on the tiny model: the settings that configure it,
the start banner, `/health`, `/metrics` and the admin endpoint, a flush of the remote tier, and a start that fails
with one clear error when Redis does not answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from prefixgate.errors import ConfigError, StoreError
from prefixgate.proxy.cli import _banner
from prefixgate.proxy.serving import SETTINGS
from prefixgate.proxy.settings import load_settings
from prefixgate.store.redis_tier import KEY_PREFIX
from tests.proxy.conftest import Serve, chat_body, engine_of, sample, scrape
from tests.services import PASSWORD, RedisServer

ADMIN = {"Authorization": "Bearer sk-admin"}


def test_remote_urls_come_from_flags_the_environment_or_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings().remote == []
    assert load_settings(remote=["redis://cache:6379/0"]).remote == ["redis://cache:6379/0"]
    monkeypatch.setenv("PREFIXGATE_REMOTE", "redis://node-a:7000, redis://node-b:7001")
    assert load_settings().remote == ["redis://node-a:7000", "redis://node-b:7001"]
    monkeypatch.setenv("PREFIXGATE_REMOTE", "")
    assert load_settings().remote == []
    monkeypatch.delenv("PREFIXGATE_REMOTE")
    config = tmp_path / "prefixgate.toml"
    config.write_text('remote = ["rediss://cache.example:6380/1"]\nremote_ttl = 3600\n')
    settings = load_settings(config)
    assert (settings.remote, settings.remote_ttl) == (["rediss://cache.example:6380/1"], 3600)


def test_a_url_that_is_not_redis_is_a_bad_setting_that_hides_its_password() -> None:
    with pytest.raises(ConfigError, match=r"remote: .*redis:// or rediss://, got 'http://:\*\*\*@cache:6379'") as error:
        load_settings(remote=["http://:hunter2@cache:6379"])
    assert "hunter2" not in str(error.value)


async def test_a_redis_that_does_not_answer_at_start_is_one_clear_error(
    serve: Serve, redis_server: RedisServer
) -> None:
    redis_server.stop()
    with pytest.raises(StoreError, match="cannot read the shared secret") as error:
        await serve(remote=[redis_server.url])
    assert "check that Redis runs" in str(error.value) and PASSWORD not in str(error.value)


async def test_the_banner_health_metrics_and_admin_show_the_remote_tier(
    serve: Serve, redis_server: RedisServer, raw_redis: redis.Redis
) -> None:
    client = await serve(remote=[redis_server.url], admin_key="sk-admin")
    banner = _banner(client.app, client.app[SETTINGS])
    assert f"  remote tier: Redis at redis://:***@127.0.0.1:{redis_server.port}/0, blocks live 86400 s" in banner
    assert PASSWORD not in banner

    response = await client.post("/v1/chat/completions", json=chat_body())
    assert response.status == 200
    await engine_of(client).wait_for_blocks()
    engine_of(client).store.wait_for_writes()
    held = len(raw_redis.keys(f"{KEY_PREFIX}*"))
    assert held > 0

    health: dict[str, Any] = await (await client.get("/health")).json()
    assert health["status"] == "ok" and health["remote"]["available"] and PASSWORD not in str(health)
    report = await (await client.get("/admin/cache", headers=ADMIN)).json()
    remote = report["remote"]
    assert (remote["entries"], remote["writes"], remote["available"]) == (held, held, True)
    assert remote["used_memory"] > 0 and remote["maxmemory_policy"] == "noeviction"  # Redis's default
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_remote_writes_total") == held
    assert sample(metrics, "prefixgate_remote_written_bytes_total") > 0
    assert remote["round_trips"] >= 1  # the request's lookup asked Redis for what no local tier held
    assert sample(metrics, "prefixgate_remote_round_trips_total") == remote["round_trips"]

    flushed = await client.post("/admin/cache/flush", json={"tier": "remote"}, headers=ADMIN)
    assert (await flushed.json())["removed"] == held
    assert raw_redis.keys(f"{KEY_PREFIX}*") == []
    assert engine_of(client).store.stats()[0].entries > 0  # the local tiers keep theirs

    redis_server.stop()
    health = await (await client.get("/health")).json()
    assert health["status"] == "degraded" and not health["remote"]["available"]
    response = await client.post("/v1/chat/completions", json=chat_body("And of Spain?"))
    assert response.status == 200  # served without Redis
    report = await (await client.get("/admin/cache", headers=ADMIN)).json()
    assert report["remote"]["entries"] is None and report["remote"]["errors"] >= 1


async def test_without_a_remote_tier_nothing_mentions_one(serve: Serve) -> None:
    client = await serve(admin_key="sk-admin")
    assert "remote" not in await (await client.get("/health")).json()
    assert (await (await client.get("/admin/cache", headers=ADMIN)).json())["remote"] is None
    assert "prefixgate_remote_up" not in await (await client.get("/metrics")).text()
    flushed = await client.post("/admin/cache/flush", json={"tier": "remote"}, headers=ADMIN)
    assert flushed.status == 400 and "host, disk" in (await flushed.json())["error"]["message"]
