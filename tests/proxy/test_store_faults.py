"""A cache never takes the service down: a damaged store at start is set aside and the server answers; a disk tier
whose writes fail turns `/health` degraded, naming it, and `/metrics` counts the failed writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import pytest

from prefixgate.store import TieredStore
from prefixgate.store.lmdb_tier import LMDBTier
from prefixgate.store.tiered_store import DISK_FOLDER
from tests.proxy.conftest import Serve, engine_of, sample, scrape
from tests.proxy.conftest import chat_body as chat
from tests.store.test_lmdb_tier import damage


def disk_tier(store: TieredStore) -> LMDBTier:
    (tier,) = [tier for tier in store.tiers if isinstance(tier, LMDBTier)]
    return tier


async def test_a_server_on_a_damaged_store_starts_sets_it_aside_counts_it_and_answers(
    serve: Serve, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    first = await serve(store=store, host_budget="0", disk_budget="64MiB")  # every block goes to disk
    assert (await first.post("/v1/chat/completions", json=chat())).status == 200
    await first.close()
    damage(store / DISK_FOLDER)

    again = await serve(store=store, host_budget="0", disk_budget="64MiB")
    response = await again.post("/v1/chat/completions", json=chat())
    assert response.status == 200
    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was kept
    assert [entry.name.split("-")[0] for entry in store.iterdir() if "damaged" in entry.name] == ["blocks.lmdb.damaged"]
    metrics = await scrape(again)
    assert sample(metrics, "prefixgate_store_set_aside_total", tier="disk") == 1
    assert (await (await again.get("/health")).json())["status"] == "ok"  # a fresh, working tier


async def test_failing_disk_writes_turn_health_degraded_and_are_counted(
    serve: Serve, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await serve(store=tmp_path / "store")
    tier = disk_tier(engine_of(client).store)

    def full(batch: Any) -> None:
        raise lmdb.Error("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(tier, "_commit", full)
    assert (await client.post("/v1/chat/completions", json=chat())).status == 200  # answered all the same
    tier.flush()
    health = await (await client.get("/health")).json()
    assert health["status"] == "degraded"
    assert health["tiers"] == {"disk": "writes fail: mdb_txn_commit: No space left on device"}
    metrics = await scrape(client)
    assert sample(metrics, "prefixgate_store_failed_writes_total", tier="disk") > 0
    assert sample(metrics, "prefixgate_store_failing", tier="disk") == 1
    assert sample(metrics, "prefixgate_store_failing", tier="host") == 0
