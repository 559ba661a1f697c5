"""POST /admin/cache/explain on the real app: how a request is laid out, what of it hits where, and why it misses."""

from __future__ import annotations

from typing import Any

from aiohttp.test_utils import TestClient

from tests.proxy.admin.test_admin import ADMIN_KEY, SYSTEM, admin, cached, chat, prompt_keys
from tests.proxy.conftest import BLOCK_SIZE, Serve, engine_of

EARLIER = "2026-11-29T10:00:00Z"
NOW = "2026-11-29T10:05:00Z"


def stamped(stamp: str, content: str = "What is the capital of France?", **fields: Any) -> dict[str, Any]:
    """Return a chat body whose system prompt starts with a timestamp."""
    return chat(content, system=f"{stamp} {SYSTEM}", **fields)


def agree(snippet: str, text: str) -> bool:
    """Return whether a snippet and a text agree as far as both go (a snippet may run on past a message)."""
    return bool(snippet) and (snippet.startswith(text) or text.startswith(snippet))


async def explain(client: TestClient[Any, Any], body: dict[str, Any]) -> Any:
    return await admin(client, "POST", "/admin/cache/explain", body)


async def test_explain_names_a_changing_timestamp_at_the_start_of_the_system_prompt_with_layout_off(
    serve: Serve,
) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, stamped(EARLIER, layout=False))
    explained = await explain(client, stamped(NOW, layout=False))
    assert explained["layout"] == {"enabled": False, "moved": []}
    departure = explained["departure"]
    assert 0 < explained["cached_tokens"] == departure["token"] < explained["reusable_tokens"]
    assert (departure["message"], departure["role"]) == (0, "system")
    assert departure["nearest"] is not None and departure["token"] > departure["block"] * BLOCK_SIZE
    # The first differing token starts at or just before the first differing character, "5" of "10:05".
    assert 10 <= departure["character"] <= NOW.index("5:00")
    assert departure["dynamic"] == {"pattern": "datetime", "value": NOW, "start": 0, "end": len(NOW)}
    assert departure["cause"].startswith(
        f"the system prompt contains a timestamp '{NOW}' at character 0 that changes between requests; "
        'layout is off for this request ("layout": false'
    )
    assert departure["cause"] in explained["summary"]
    character = departure["character"]
    assert agree(departure["cached_text"], f"{EARLIER} {SYSTEM}"[character:])
    assert agree(departure["prompt_text"], f"{NOW} {SYSTEM}"[character:])


async def test_explain_reports_the_timestamp_as_moved_with_layout_on_and_hits_past_it(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, stamped(EARLIER))
    explained = await explain(client, stamped(NOW))
    assert explained["layout"] == {
        "enabled": True,
        "moved": [{"pattern": "datetime", "value": NOW, "message": 0, "character": 0}],
    }
    system, user = explained["messages"]
    assert system["content"].startswith("[datetime 1] ") and NOW not in system["content"]
    assert user["content"].endswith(f"[datetime 1] = {NOW})")
    departure = explained["departure"]
    assert explained["cached_tokens"] > 100  # the whole system prompt, past where the timestamp was
    # The question is the same; what differs is the timestamp layout appended to it.
    assert (departure["message"], departure["role"]) == (1, "user")
    assert departure["dynamic"]["value"] == NOW and user["content"].index(NOW) == departure["dynamic"]["start"]
    assert f"contains a timestamp '{NOW}'" in departure["cause"] and "layout moved it there" in departure["cause"]


async def test_explain_of_a_repeated_prompt_is_a_full_hit_with_no_departure(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    explained = await explain(client, chat())
    assert explained["departure"] is None
    assert explained["cached_tokens"] == explained["reusable_tokens"] == explained["prompt_tokens"] - 1
    assert explained["cached_tokens_by_tier"] == {"host": explained["cached_tokens"], "disk": 0}
    assert "every token before the last" in explained["summary"]


async def test_explain_of_a_cold_prompt_says_nothing_cached_starts_like_it(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    explained = await explain(client, chat())
    departure = explained["departure"]
    assert explained["cached_tokens"] == 0 and departure["token"] == 0 and departure["nearest"] is None
    assert departure["cause"].startswith("nothing cached in this namespace")
    assert departure["message"] == 0 and departure["character"] is None  # block 0 starts with template text


async def test_explain_finds_where_a_new_question_departs_in_the_last_message(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat("What is the capital of France?"))
    explained = await explain(client, chat("What is the capital of Spain?"))
    departure = explained["departure"]
    assert (departure["message"], departure["role"]) == (1, "user")
    assert departure["character"] <= len("What is the capital of ") <= departure["character"] + 4
    assert agree(departure["cached_text"], "What is the capital of France?"[departure["character"] :])
    assert agree(departure["prompt_text"], "What is the capital of Spain?"[departure["character"] :])


async def test_explain_after_a_delete_says_nothing_was_cached_beyond_that_point(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    keys = await prompt_keys(client, chat())
    await admin(client, "DELETE", f"/admin/cache/entries/{keys[5].hex()}")
    departure = (await explain(client, chat()))["departure"]
    assert (departure["block"], departure["token"], departure["nearest"]) == (5, 40, None)
    assert departure["cause"].startswith("nothing was ever cached beyond token 40 of this prefix")
    assert departure["message"] == 0 and departure["character"] is not None


async def test_explain_is_a_dry_run_that_loads_moves_and_counts_nothing(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await cached(client, chat())
    engine = engine_of(client)
    await engine.wait_for_blocks()  # the answer's last block may still be on its way to the store
    engine.store.flush("host")  # what is cached is on disk only: a fetch would promote it
    before = (engine.store.stats(), engine.stats.snapshot(), engine.store.entries())
    explained = await explain(client, chat())
    assert explained["cached_tokens_by_tier"] == {"host": 0, "disk": explained["cached_tokens"]}
    assert (engine.store.stats(), engine.stats.snapshot(), engine.store.entries()) == before


async def test_explain_of_a_partial_hit_reads_the_nearest_blocks_without_touching_any_tier(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    await admin(client, "POST", "/admin/cache/warm", chat("What is the capital of France?"))  # stored on return
    store = engine_of(client).store
    for flushed in ("nothing", "host"):  # nearest blocks read from the host tier, then from the disk tier alone
        if flushed == "host":
            store.flush("host")
        before = (store.stats(), store.entries(), [tier.victim() for tier in store.tiers])
        explained = await explain(client, chat("What is the capital of Spain?"))
        assert 0 < explained["cached_tokens"] < explained["reusable_tokens"]
        assert explained["departure"]["nearest"] is not None, "the nearest cached block was read"
        # Hit counts, last use and each tier's eviction order are as they were.
        assert (store.stats(), store.entries(), [tier.victim() for tier in store.tiers]) == before, flushed


async def test_explain_for_a_tenant_sees_only_that_tenants_cache(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY, api_keys={"key-a": "acme", "key-b": "globex"})
    await cached(client, chat(), "key-a")
    assert (await explain(client, chat(tenant="acme")))["departure"] is None
    explained = await explain(client, chat(tenant="globex"))
    assert explained["tenant"] == "globex" and explained["cached_tokens"] == 0
    assert explained["departure"]["nearest"] is None  # acme's blocks are not globex's nearest prefix


async def test_explain_lists_the_messages_canonicalization_changed(serve: Serve) -> None:
    client = await serve(admin_key=ADMIN_KEY)
    explained = await explain(client, chat("Line one\r\nLine two"))
    assert explained["canonicalized"] == [1]
    assert explained["messages"][1]["content"] == "Line one\nLine two"
