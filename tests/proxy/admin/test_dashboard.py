"""The admin dashboard, driven in headless Chromium against the real app: what it shows matches `/admin/cache`.

Chromium runs as a subprocess (`--dump-dom` after a virtual-time budget, so the page's polling runs several times
in a second of wall time) while this test's event loop keeps serving the app it calls.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.proxy.conftest import MODEL, SYSTEM, Serve, engine_of
from tests.services import RedisServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed; install it with: apt-get install -y chromium"
)

ADMIN_KEY = "dashboard-admin-key"
# Virtual milliseconds the page runs for: three polls at one every five seconds.
BUDGET_MS = 12_000


class Page(HTMLParser):
    """Collect what the page shows: `data-k` elements' values and texts, and elements by id."""

    VOID = frozenset({"area", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"})

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.values: dict[str, str] = {}  # data-k -> data-v (the raw number behind a formatted one)
        self.texts: dict[str, list[str]] = {}  # data-k or id -> the text of each such element
        self.by_id: dict[str, dict[str, str | None]] = {}
        self.prefix_keys: list[str] = []
        self.polylines = 0
        self._stack: list[tuple[str, str | None]] = []
        self.feed(dom)

    def text(self, name: str) -> str:
        """Return the text of the first element named `name` (by data-k or id)."""
        return self.texts[name][0]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        name = found.get("data-k") or found.get("id")
        if found.get("id"):
            self.by_id[str(found["id"])] = found
        if found.get("data-k") == "prefix":
            self.prefix_keys.append(str(found["data-key"]))
        elif found.get("data-k") and found.get("data-v") is not None:
            self.values.setdefault(str(found["data-k"]), str(found["data-v"]))
        self.polylines += tag == "polyline"
        if name is not None:
            self.texts.setdefault(name, []).append("")
        if tag not in self.VOID:
            self._stack.append((tag, name))

    def handle_data(self, data: str) -> None:
        for _, name in self._stack:
            if name is not None:
                self.texts[name][-1] += data

    def handle_endtag(self, tag: str) -> None:
        if self._stack and self._stack[-1][0] == tag:
            self._stack.pop()


async def open_page(client: TestClient[Any, Any], tmp_path: Path, fragment: str = "") -> Page:
    """Load /admin/ in headless Chromium and return the page as it stands when the budget runs out."""
    assert CHROMIUM is not None
    url = str(client.make_url("/admin/")) + fragment
    process = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # tests run as root in CI containers, where the sandbox cannot start
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium'}",
        f"--virtual-time-budget={BUDGET_MS}",
        "--dump-dom",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, err.decode(errors="replace")[-2000:]
    return Page(out.decode())


async def admin(client: TestClient[Any, Any], path: str) -> Any:
    response = await client.get(path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert response.status == 200
    return await response.json()


async def test_dashboard_shows_what_admin_cache_reports(serve: Serve, tmp_path: Path) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    for question in ("What is the capital of France?", "What is the capital of France?", "And of Spain?"):
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 4,
            "temperature": 0,
        }
        assert (await client.post("/v1/chat/completions", json=body)).status == 200

    page = await open_page(client, tmp_path, f"#key={ADMIN_KEY}")
    report = await admin(client, "/admin/cache")  # nothing ran since the page polled, so the numbers agree

    assert page.by_id["status"]["data-state"] == "ok"
    assert "hidden" in page.by_id["login"] and "hidden" not in page.by_id["main"]
    totals = report["totals"]
    assert totals["tokens_saved"] > 0
    for field in ("entries", "bytes", "stored_bytes", "requests", "tokens_saved", "evictions"):
        assert int(page.values[f"totals.{field}"]) == totals[field], field
    assert float(page.values["totals.hit_rate"]) == pytest.approx(totals["hit_rate"])
    assert float(page.values["totals.prefill_seconds_saved"]) == totals["prefill_seconds_saved"] > 0
    assert totals["cost_saved"] is None and "totals.cost_saved" not in page.values  # no prices, no money
    for tier in report["tiers"]:
        for field in ("entries", "bytes", "capacity", "hits", "misses", "tokens_saved", "demotions", "dropped_writes"):
            assert int(page.values[f"tier.{tier['name']}.{field}"]) == tier[field], (tier["name"], field)
        occupancy = float(page.values[f"tier.{tier['name']}.occupancy"])
        assert occupancy == pytest.approx(tier["bytes"] / tier["capacity"])
    (tenant,) = report["tenants"]
    assert int(page.values["tenant..requests"]) == tenant["requests"] == 3
    assert float(page.values["tenant..hit_rate"]) == pytest.approx(tenant["hit_rate"])

    # The history chart has a line per series (hit rate, then each tier's occupancy) over several polls.
    assert int(str(page.by_id["chart-rates"]["data-samples"])) >= 2
    assert page.polylines == 1 + len(report["tiers"]) + 1
    # Axes: the top of each scale, and the times of the oldest and newest samples (5 s apart at least).
    assert page.text("chart-rates-top") == "100.0%"
    assert page.text("chart-saved-top") == f"{totals['tokens_saved']:,}"
    for chart in ("chart-rates", "chart-saved"):
        oldest, newest = page.text(f"{chart}-from"), page.text(f"{chart}-to")
        assert re.fullmatch(r"\d{1,2}:\d{2}:\d{2}( [AP]M)?", oldest) and oldest != newest, (oldest, newest)

    prefixes = (await admin(client, "/admin/cache/prefixes?limit=8"))["data"]
    assert page.prefix_keys == [prefix["key"] for prefix in prefixes]
    longest = prefixes[0]
    assert int(page.values["prefix.tokens"]) == longest["tokens"]
    first = await admin(client, f"/admin/cache/entries/{longest['root']}")
    last = await admin(client, f"/admin/cache/entries/{longest['key']}")
    assert page.text("prefix.start") == first["text"] and "system" in first["text"]
    assert page.text("prefix.end") == last["text"] and last["text"]


async def test_dashboard_shows_the_remote_tier_only_when_there_is_one(
    serve: Serve, tmp_path: Path, redis_server: RedisServer
) -> None:
    client = await serve(admin_key=ADMIN_KEY, remote=[redis_server.url])
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    await engine_of(client).wait_for_blocks()
    engine_of(client).store.wait_for_writes()
    page = await open_page(client, tmp_path, f"#key={ADMIN_KEY}")
    remote = (await admin(client, "/admin/cache"))["remote"]
    assert "hidden" not in page.by_id["remote-section"]
    assert remote["entries"] > 0
    for field in ("entries", "hits", "misses", "errors", "round_trips", "writes", "dropped_writes"):
        assert int(page.values[f"remote.{field}"]) == remote[field], field
    assert int(page.values["remote.used_memory"]) > 0  # Redis's own, which moves with every client it serves
    assert page.text("remote.maxmemory") == "no limit" and page.text("remote.available") == "available"

    local = await serve(admin_key=ADMIN_KEY, store=tmp_path / "local")
    assert "hidden" in (await open_page(local, tmp_path, f"#key={ADMIN_KEY}")).by_id["remote-section"]


async def test_dashboard_asks_for_the_key_when_it_has_none(serve: Serve, tmp_path: Path) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    page = await open_page(client, tmp_path)
    assert page.by_id["status"]["data-state"] == "nokey"
    assert "hidden" not in page.by_id["login"] and "hidden" in page.by_id["main"]
    assert not page.values  # no data without the key


async def test_dashboard_says_a_wrong_key_was_refused(serve: Serve, tmp_path: Path) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    page = await open_page(client, tmp_path, "#key=not-the-key")
    assert page.by_id["status"]["data-state"] == "nokey"
    assert "hidden" not in page.by_id["login"]
    assert "admin key was refused" in page.text("login-message")
    assert not page.values
