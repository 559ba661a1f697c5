"""The admin endpoint on the real app: its key, inspection, eviction, flushes, warming, parameters and audit log."""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from prefixgate.errors import ConfigError
from prefixgate.proxy.openai.api import ChatCompletionRequest
from prefixgate.proxy.settings import load_settings
from prefixgate.store import BlockKey
from tests.proxy.conftest import BLOCK_SIZE, MODEL, SYSTEM, Serve, chat_body, engine_of

ADMIN_KEY = "admin-key-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
UNKNOWN_KEY = "0" * 32
BLOCK_BYTES = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4  # the tiny Llama's layers, K and V, KV heads, block, head dim, float32


chat = functools.partial(chat_body, max_tokens=4)


async def cached(client: TestClient[Any, Any], body: dict[str, Any], key: str | None = None) -> int:
    """Send a chat request; return its cached prompt tokens once the blocks it computed are in the store."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status == 200, await response.text()
    await engine_of(client).wait_for_blocks()  # the last ones may be filed after the response went out
    return int((await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


async def admin(client: TestClient[Any, Any], method: str, path: str, body: Any = None, status: int = 200) -> Any:
    """Call an admin route with the admin key; check the status and return the JSON body."""
    response = await client.request(method, path, json=body, headers=ADMIN)
    assert response.status == status, await response.text()
    return await response.json()


async def prompt_keys(client: TestClient[Any, Any], body: dict[str, Any], tenant: str = "") -> list[BlockKey]:
    """Return the keys of a chat body's full prompt blocks, as the engine computes them."""
    prepared = await engine_of(client).prepare(ChatCompletionRequest.model_validate(body).to_prompt_request(tenant))
    return list(prepared.keys)


ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/admin/cache", None),
    ("GET", "/admin/cache/entries", None),
    ("GET", "/admin/cache/prefixes", None),
    ("GET", f"/admin/cache/entries/{UNKNOWN_KEY}", None),
    ("DELETE", f"/admin/cache/entries/{UNKNOWN_KEY}", None),
    ("POST", "/admin/cache/flush", {}),
    ("POST", "/admin/cache/warm", chat()),
    ("POST", "/admin/cache/explain", chat()),
]


async def test_every_admin_route_answers_403_when_no_admin_key_is_set(serve: Serve) -> None:
    client = await serve()
    for method, path, body in [*ROUTES, ("GET", "/admin/", None)]:
        response = await client.request(method, path, json=body, headers=ADMIN)
        assert response.status == 403, path
        error = (await response.json())["error"]
        assert error["code"] == "admin_disabled" and "--admin-key" in error["message"]


async def test_a_missing_or_wrong_admin_key_or_an_api_key_gets_401_and_changes_nothing(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme"})
    await cached(client, chat(), "key-a")
    held = len(engine_of(client).store.entries())
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer key-a"},
        {"Authorization": ADMIN_KEY},
    ):
        for method, path, body in ROUTES:
            response = await client.request(method, path, json=body, headers=headers)
            assert response.status == 401, (headers, path)
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
            error = (await response.json())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_admin_key"
    assert len(engine_of(client).store.entries()) == held  # no flush or delete got through
    assert (await client.post("/v1/chat/completions", json=chat(), headers=ADMIN)).status == 401  # nor the reverse


async def test_the_dashboard_page_needs_no_key_and_holds_no_data(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat("A question that must not leak"))
    response = await client.get("/admin/")
    assert response.status == 200 and response.content_type == "text/html"
    page = await response.text()
    assert "must not leak" not in page
    assert "http" not in page.replace('"http://www.w3.org/2000/svg"', ""), "the page loads nothing from elsewhere"
    assert "default-src 'none'" in response.headers["Content-Security-Policy"]
    redirect = await client.get("/admin", allow_redirects=False)
    assert redirect.status == 308 and redirect.headers["Location"] == "/admin/"


async def test_cache_reports_totals_tiers_and_each_tenant(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme", "key-b": "globex"})
    assert await cached(client, chat(), "key-a") == 0
    hit = await cached(client, chat(), "key-a")
    assert hit > 0
    assert await cached(client, chat(), "key-b") == 0
    report = await admin(client, "GET", "/admin/cache")
    store = engine_of(client).store
    tenants = {tenant["tenant"]: tenant for tenant in report["tenants"]}
    assert set(tenants) == {"acme", "globex"}
    acme, globex = tenants["acme"], tenants["globex"]
    assert acme["requests"] == 2 and globex["requests"] == 1
    assert acme["hit_tokens"] == acme["tokens_saved"] == hit and globex["hit_tokens"] == 0
    assert acme["miss_tokens"] == acme["prompt_tokens"] - hit
    assert acme["prompt_tokens"] == 2 * globex["prompt_tokens"] == 2 * globex["miss_tokens"]
    block_bytes = store.layout.nbytes
    for name in ("acme", "globex"):
        found = store.entries(tenant=name)
        assert tenants[name]["entries"] == len({entry.key for entry in found}) > 0
        # Every block is in the host tier and written through to disk: two copies, one block's bytes.
        assert len(found) == 2 * tenants[name]["entries"]
        assert tenants[name]["bytes"] == tenants[name]["entries"] * block_bytes
        assert tenants[name]["stored_bytes"] == 2 * tenants[name]["bytes"]
    totals = report["totals"]
    assert totals["requests"] == 3 and totals["tokens_saved"] == hit
    assert totals["entries"] == acme["entries"] + globex["entries"]
    assert totals["bytes"] == totals["entries"] * block_bytes
    assert totals["stored_bytes"] == sum(tier.bytes for tier in store.stats()) == 2 * totals["bytes"]
    assert [tier["name"] for tier in report["tiers"]] == ["host", "disk"]
    for tier, stats in zip(report["tiers"], store.stats(), strict=True):
        assert (tier["entries"], tier["bytes"], tier["capacity"]) == (stats.entries, stats.bytes, stats.capacity)
        assert tier["hit_tokens"] == stats.hits * BLOCK_SIZE and tier["miss_tokens"] == stats.misses * BLOCK_SIZE
        assert {"evictions", "expirations", "promotions", "demotions", "corrupt"} <= set(tier)
    assert report["tiers"][0]["tokens_saved"] == hit


async def test_entries_are_paged_and_filtered_by_tier_and_tenant(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme", "key-b": "globex"})
    await cached(client, chat(), "key-a")
    await cached(client, chat("Something else entirely"), "key-b")
    everything = await admin(client, "GET", "/admin/cache/entries?limit=1000")
    assert everything["total"] == len(engine_of(client).store.entries()) == len(everything["data"])
    assert everything["next_offset"] is None
    pages, offset = [], 0
    while offset is not None:
        page = await admin(client, "GET", f"/admin/cache/entries?limit=7&offset={offset}")
        assert len(page["data"]) <= 7
        pages += page["data"]
        offset = page["next_offset"]
    assert pages == everything["data"]
    entry = pages[0]
    assert set(entry) == {
        "key", "tier", "tokens", "bytes", "created", "last_access", "expires_at", "hits", "pinned", "retained_until",
        "tenant", "parent",
    }  # fmt: skip
    host = await admin(client, "GET", "/admin/cache/entries?tier=host&limit=1000")
    assert host["data"] and all(item["tier"] == "host" for item in host["data"])
    acme = await admin(client, "GET", "/admin/cache/entries?tenant=acme&tier=disk&limit=1000")
    assert acme["data"] and all(item["tenant"] == "acme" and item["tier"] == "disk" for item in acme["data"])
    assert acme["total"] == len(engine_of(client).store.entries(tier="disk", tenant="acme"))


async def test_an_entry_shows_every_tier_holding_it_and_its_text(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    body = chat()
    await cached(client, body)
    keys = await prompt_keys(client, body)
    shown = await admin(client, "GET", f"/admin/cache/entries/{keys[2].hex()}")
    assert shown["key"] == keys[2].hex() and shown["parent"] == keys[1].hex()
    assert sorted(entry["tier"] for entry in shown["entries"]) == ["disk", "host"]
    assert shown["tokens"] == BLOCK_SIZE == len(shown["token_ids"])
    assert shown["text"] == engine_of(client).backend.decode(shown["token_ids"]) and shown["text"] in SYSTEM
    missing = await admin(client, "GET", f"/admin/cache/entries/{UNKNOWN_KEY}", status=404)
    assert missing["error"]["code"] == "not_found"


async def test_deleting_an_entry_makes_the_next_request_miss_from_there(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    body = chat()
    await cached(client, body)
    keys = await prompt_keys(client, body)
    deleted = await admin(client, "DELETE", f"/admin/cache/entries/{keys[3].hex()}")
    assert deleted == {"object": "cache.deleted", "key": keys[3].hex(), "extensions": False, "removed": 2}
    assert await cached(client, body) == 3 * BLOCK_SIZE
    await admin(client, "DELETE", f"/admin/cache/entries/{keys[3].hex()}")
    await admin(client, "DELETE", f"/admin/cache/entries/{keys[3].hex()}", status=404)  # gone already


async def test_deleting_with_extensions_removes_everything_that_extends_the_entry(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    await cached(client, chat("A different question"))
    keys = await prompt_keys(client, chat())
    store = engine_of(client).store
    held = len(store.entries())
    deleted = await admin(client, "DELETE", f"/admin/cache/entries/{keys[1].hex()}?extensions=true")
    assert deleted["removed"] == held - 2  # all but block 0, in both tiers
    assert {entry.key for entry in store.entries()} == {keys[0]}
    assert await cached(client, chat("A different question")) == BLOCK_SIZE


async def test_flushing_a_tier_a_tenant_or_everything_makes_requests_miss_there(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme", "key-b": "globex"})
    for key in ("key-a", "key-b"):
        await cached(client, chat(), key)
    flushed = await admin(client, "POST", "/admin/cache/flush", {"tier": "host"})
    assert flushed["tier"] == "host" and flushed["removed"] > 0
    assert engine_of(client).store.entries(tier="host") == []
    assert await cached(client, chat(), "key-a") > 0  # served from disk
    flushed = await admin(client, "POST", "/admin/cache/flush", {"tenant": "globex"})
    assert flushed["tenant"] == "globex" and flushed["removed"] > 0
    assert engine_of(client).store.entries(tenant="globex") == []
    assert await cached(client, chat(), "key-b") == 0
    assert await cached(client, chat(), "key-a") > 0  # another tenant's blocks stay
    response = await client.post("/admin/cache/flush", headers=ADMIN)  # no body: everything
    assert response.status == 200 and (await response.json())["removed"] > 0
    assert engine_of(client).store.entries() == []
    assert await cached(client, chat(), "key-a") == 0


async def test_a_flush_while_a_request_streams_leaves_both_working(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    response = await client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=40))
    await response.content.readline()  # generation is running, from cached blocks
    await admin(client, "POST", "/admin/cache/flush", {})
    rest = (await response.content.read()).decode()
    assert rest.rstrip().endswith("data: [DONE]") and "event: error" not in rest
    assert await cached(client, chat()) == 0
    assert await cached(client, chat()) > 0


async def test_a_warmed_prompt_hits_on_its_first_real_request(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme"})
    warmed = await admin(client, "POST", "/admin/cache/warm", chat(tenant="acme"))
    prompt = warmed["prompt_tokens"]
    assert warmed["computed_tokens"] == prompt // BLOCK_SIZE * BLOCK_SIZE
    assert warmed["cached_tokens"] == (prompt - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert await cached(client, chat(), "key-a") == warmed["cached_tokens"]
    again = await admin(client, "POST", "/admin/cache/warm", chat(tenant="acme"))
    # The request's answer completed the block holding the prompt's last tokens: all but the last one are cached now.
    assert again["computed_tokens"] == 0 and again["cached_tokens"] == prompt - 1
    report = await admin(client, "GET", "/admin/cache")
    assert report["totals"]["requests"] == 1  # warming is no request


async def test_warm_and_explain_take_a_text_completion_body_too(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    body = {"model": MODEL, "prompt": SYSTEM + "The capital of France is", "max_tokens": 4, "temperature": 0}
    before = await admin(client, "POST", "/admin/cache/explain", body)
    assert before["cached_tokens"] == 0 and "the prompt" in before["summary"]
    warmed = await admin(client, "POST", "/admin/cache/warm", body | {"pinned": True})
    assert warmed["cached_tokens"] == (warmed["prompt_tokens"] - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    assert (await admin(client, "POST", "/admin/cache/explain", body))["cached_tokens"] == warmed["cached_tokens"]
    response = await client.post("/v1/completions", json=body)
    assert (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == warmed["cached_tokens"]

    # A text body's errors name `prompt`; a body of both shapes is taken for a text one, and told to drop `messages`.
    empty_text = await admin(client, "POST", "/admin/cache/explain", body | {"prompt": [""]}, status=400)
    assert empty_text["error"]["param"] == "prompt"
    both = await admin(client, "POST", "/admin/cache/warm", body | {"messages": chat()["messages"]}, status=400)
    assert both["error"]["param"] == "messages" and "unknown field" in both["error"]["message"]


async def test_a_pinned_warm_survives_eviction_pressure_and_an_unpinned_one_does_not(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, store="", host_budget=40 * BLOCK_BYTES)  # no disk tier
    assert engine_of(client).backend.geometry.block_nbytes == BLOCK_BYTES
    pinned_body, loose_body = chat(system="Pinned. " + SYSTEM), chat(system="Loose. " + SYSTEM)
    loose = await admin(client, "POST", "/admin/cache/warm", loose_body)
    pinned = await admin(client, "POST", "/admin/cache/warm", pinned_body | {"pinned": True, "ttl": 3600})
    assert pinned["pinned"] and pinned["cached_tokens"] > 10 * BLOCK_SIZE
    for number in range(5):  # about 70 new blocks through a 40-block tier
        await cached(client, chat(system=f"Pressure {number}. " + SYSTEM))
    assert engine_of(client).store.stats()[0].evictions > 0
    assert await cached(client, pinned_body) == pinned["cached_tokens"]
    assert await cached(client, loose_body) < loose["cached_tokens"]
    entries = (await admin(client, "GET", "/admin/cache/entries?limit=1000"))["data"]
    pinned_keys = {key.hex() for key in await prompt_keys(client, pinned_body)}
    shown = [entry for entry in entries if entry["key"] in pinned_keys]
    assert shown and all(entry["pinned"] and entry["expires_at"] is not None for entry in shown)


async def test_prefixes_lists_the_longest_chains_first(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat("Short"))
    await cached(client, chat("A much longer question about the capital of France, and of Spain too. " * 3))
    chains = (await admin(client, "GET", "/admin/cache/prefixes?limit=5"))["data"]
    assert len(chains) == 2 and chains[0]["tokens"] > chains[1]["tokens"]
    longest = chains[0]
    assert longest["complete"] and longest["tiers"] == {"host": longest["blocks"], "disk": longest["blocks"]}
    assert (longest["blocks"] - 1) * BLOCK_SIZE < longest["tokens"] <= longest["blocks"] * BLOCK_SIZE  # ends in a tail
    first = await admin(client, "GET", f"/admin/cache/entries/{longest['root']}")
    assert first["parent"] is None


BAD: list[tuple[str, str, Any, int, str, str | None]] = [
    ("GET", "/admin/cache/entries?limit=-1", None, 400, "limit must be between 1 and 1000", "limit"),
    ("GET", "/admin/cache/entries?limit=ten", None, 400, "limit must be an integer", "limit"),
    ("GET", "/admin/cache/entries?offset=-3", None, 400, "offset must be at least 0", "offset"),
    ("GET", "/admin/cache/entries?tier=gpu", None, 400, "unknown tier 'gpu'; this store has: host, disk", "tier"),
    ("GET", "/admin/cache/entries?teir=host", None, 400, "unknown query parameter 'teir'", "teir"),
    ("GET", "/admin/cache/prefixes?limit=0", None, 400, "limit must be between", "limit"),
    ("GET", "/admin/cache/entries/xyz", None, 400, "malformed entry key 'xyz'", "key"),
    ("GET", f"/admin/cache/entries/{'ab' * 15}", None, 400, "32 hex digits", "key"),
    ("DELETE", f"/admin/cache/entries/{UNKNOWN_KEY}?extensions=maybe", None, 400, "true or false", "extensions"),
    ("POST", "/admin/cache/flush", {"tier": "gpu"}, 400, "unknown tier 'gpu'", "tier"),
    ("POST", "/admin/cache/flush", {"tier": "host", "tenant": "acme"}, 400, "not both", None),
    ("POST", "/admin/cache/flush", {"everything": True}, 400, "unknown field", "everything"),
    ("POST", "/admin/cache/flush", [1], 400, "JSON object", None),
    ("POST", "/admin/cache/warm", chat(ttl=-5), 400, "greater than 0", "ttl"),
    ("POST", "/admin/cache/warm", chat(tenant="initech"), 400, "unknown tenant 'initech'", "tenant"),
    ("POST", "/admin/cache/warm", chat(model="gpt-9"), 404, "does not exist here", "model"),
    ("POST", "/admin/cache/explain", {"model": MODEL}, 400, "required", "messages"),
]


@pytest.mark.parametrize("method, path, body, status, words, param", BAD, ids=[f"{r[0]} {r[1]} {r[2]}" for r in BAD])
async def test_bad_admin_parameters_get_a_clear_error(
    serve: Serve, method: str, path: str, body: Any, status: int, words: str, param: str | None
) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    error = (await admin(client, method, path, body, status=status))["error"]
    assert words in error["message"]
    assert error["param"] == param


async def test_warm_and_explain_must_name_a_tenant_when_api_keys_are_set(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme", "key-b": "globex"})
    for path in ("/admin/cache/warm", "/admin/cache/explain"):
        error = (await admin(client, "POST", path, chat(), status=400))["error"]
        assert error["param"] == "tenant" and "'acme', 'globex'" in error["message"]


async def test_admin_actions_are_logged_with_who_from_where_and_what(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    keys = await prompt_keys(client, chat())
    with caplog.at_level(logging.DEBUG, logger="prefixgate.proxy.admin"):
        await admin(client, "DELETE", f"/admin/cache/entries/{keys[4].hex()}")
        await admin(client, "POST", "/admin/cache/flush", {"tier": "host"})
        await admin(client, "GET", "/admin/cache")
        await client.get("/admin/cache", headers={"Authorization": "Bearer guess"})
    lines = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert all(ADMIN_KEY not in line and "guess" not in line for _, line in lines)
    delete, flush, read, refused = lines
    assert delete[0] == logging.INFO and "admin#" in delete[1] and "127.0.0.1" in delete[1]
    assert f'delete {{"extensions": false, "key": "{keys[4].hex()}", "removed": 2}}' in delete[1]
    assert flush[0] == logging.INFO and 'flush {"removed":' in flush[1] and '"tier": "host"' in flush[1]
    assert read[0] == logging.DEBUG and "cache {}" in read[1]
    assert refused[0] == logging.WARNING and "wrong admin key" in refused[1] and "127.0.0.1" in refused[1]


def test_an_admin_key_that_is_also_an_api_key_is_refused_at_startup() -> None:
    with pytest.raises(ConfigError, match="admin_key is also an API key"):
        load_settings(admin_key="shared", api_keys={"shared": "acme"})
    with pytest.raises(ConfigError, match="must not be empty"):
        load_settings(admin_key="  ")
