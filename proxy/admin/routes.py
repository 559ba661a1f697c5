"""The admin endpoint under /admin: inspect, evict, flush, warm and explain the cache, and the dashboard page.

Every route but the dashboard page needs `Authorization: Bearer <admin key>`: a key of its own, never an API key.
With no admin key configured every route answers 403. Handlers parse, call the engine or the store (in a worker
thread: the store blocks), render, and log who did what.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from prefixgate.errors import RequestError
from prefixgate.proxy.admin import params
from prefixgate.proxy.admin.cache_report import (
    cache_report,
    entry_body,
    longest_prefixes,
    money,
    prefix_body,
    sort_entries,
)
from prefixgate.proxy.admin.dashboard import dashboard
from prefixgate.proxy.admin.params import (
    ChatExplainRequest,
    ChatWarmRequest,
    ExplainRequest,
    FlushRequest,
    TextExplainRequest,
    TextWarmRequest,
)
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.explain import explanation_body, route_explanation_body
from prefixgate.proxy.openai import api
from prefixgate.proxy.serving import ENGINE, SETTINGS, Handler, ModelNotServed, local_engine, upstream_state
from prefixgate.proxy.settings import ModelPrices
from prefixgate.proxy.upstream_engine import UpstreamEngine
from prefixgate.store import Block, BlockKey, EntryInfo, TieredStore, TierStats
from prefixgate.store.redis_tier import RedisStats, RedisUsage

log = logging.getLogger(__name__)

ADMIN = web.RequestKey("admin", str)  # who: a short hash of the admin key, never the key
_Result = TypeVar("_Result")


def add_admin(app: web.Application) -> None:
    """Mount the admin endpoint and the dashboard under /admin; `app` holds the engine and the settings."""
    app.router.add_get("/admin", _to_dashboard)  # before the sub-app, which would take the path otherwise
    app.add_subapp("/admin", admin_app())


def admin_app() -> web.Application:
    """Build the /admin sub-app."""
    admin = web.Application(middlewares=[_guard])
    admin.router.add_get("/", dashboard, name="dashboard")
    admin.router.add_get("/cache", cache)
    admin.router.add_get("/cache/entries", entries)
    admin.router.add_get("/cache/prefixes", prefixes)
    admin.router.add_get("/cache/entries/{key}", entry)
    admin.router.add_delete("/cache/entries/{key}", delete_entry)
    admin.router.add_post("/cache/flush", flush)
    admin.router.add_post("/cache/warm", warm)
    admin.router.add_post("/cache/explain", explain)
    return admin


# -- handlers -----------------------------------------------------------------------------------------------------


async def cache(request: web.Request) -> web.Response:
    """GET /admin/cache: totals, each tier and each tenant."""
    params.query(request)
    engine = request.config_dict[ENGINE]
    if isinstance(engine, UpstreamEngine):
        _audit(request, "cache")
        return web.json_response(upstream_report(engine, request.config_dict[SETTINGS].prices.get(engine.model_id)))
    tiers, found, remote = await asyncio.to_thread(_inventory, engine.store)
    _audit(request, "cache")
    block_size = engine.backend.geometry.block_size
    prices = request.config_dict[SETTINGS].prices.get(engine.model_id)
    return web.json_response(cache_report(tiers, engine.stats.snapshot(), found, block_size, remote, prices))


async def entries(request: web.Request) -> web.Response:
    """GET /admin/cache/entries?limit=&offset=&tier=&tenant=: the cached entries, one per block and tier."""
    query = params.query(request, "limit", "offset", "tier", "tenant")
    engine = local_engine(request)
    tier = params.tier_name(query.get("tier"), _tier_names(engine))
    limit = params.integer(query, "limit", 100, 1, params.MAX_LIMIT)
    offset = params.integer(query, "offset", 0, 0)
    found = await asyncio.to_thread(engine.store.entries, tier=tier, tenant=query.get("tenant"))
    _audit(request, "entries", **query)
    page = sort_entries(found, _tier_names(engine))[offset : offset + limit]
    more = offset + limit < len(found)
    return web.json_response(
        {
            "object": "list",
            "data": [entry_body(info) for info in page],
            "total": len(found),
            "offset": offset,
            "limit": limit,
            "next_offset": offset + limit if more else None,
        }
    )


async def prefixes(request: web.Request) -> web.Response:
    """GET /admin/cache/prefixes?limit=&tenant=: the longest chains of cached blocks."""
    query = params.query(request, "limit", "tenant")
    engine = local_engine(request)
    limit = params.integer(query, "limit", 10, 1, params.MAX_LIMIT)
    found = await asyncio.to_thread(engine.store.entries, tenant=query.get("tenant"))
    _audit(request, "prefixes", **query)
    chains = [prefix_body(prefix) for prefix in longest_prefixes(found, limit)]
    return web.json_response({"object": "list", "data": chains})


async def entry(request: web.Request) -> web.Response:
    """GET /admin/cache/entries/{key}: one block in every tier holding it, with the text its tokens decode to."""
    params.query(request)
    engine = local_engine(request)
    key = params.block_key(request.match_info["key"])
    infos, block = await asyncio.to_thread(_read, engine.store, key)
    _audit(request, "entry", key=key.hex())
    if not infos or block is None:
        return _not_found(f"no cached entry has the key {key.hex()}")
    text = await asyncio.to_thread(engine.backend.decode, block.tokens)
    return web.json_response(
        {
            "object": "cache.entry",
            "key": key.hex(),
            "tenant": block.tenant,
            "parent": block.parent.hex() if block.parent is not None else None,
            "tokens": len(block.tokens),
            "token_ids": list(block.tokens),
            "text": text,
            "entries": [entry_body(info) for info in infos],
        }
    )


async def delete_entry(request: web.Request) -> web.Response:
    """DELETE /admin/cache/entries/{key}?extensions=: evict one block (and, asked, every block extending it)."""
    query = params.query(request, "extensions")
    engine = local_engine(request)
    key = params.block_key(request.match_info["key"])
    extensions = params.boolean(query, "extensions")
    removed = await asyncio.to_thread(engine.store.delete, key, extensions=extensions)
    _audit(request, "delete", key=key.hex(), extensions=extensions, removed=removed)
    if not removed:
        return _not_found(f"no cached entry has the key {key.hex()}")
    return web.json_response(
        {"object": "cache.deleted", "key": key.hex(), "extensions": extensions, "removed": removed}
    )


async def flush(request: web.Request) -> web.Response:
    """POST /admin/cache/flush {tier?, tenant?}: drop every block, one tier's, or one tenant's."""
    params.query(request)
    body = await params.parse_body(request, FlushRequest)
    engine = local_engine(request)
    if body.tier is not None and body.tenant is not None:
        raise RequestError("send tier or tenant, not both: a tenant's blocks are dropped from every tier")
    tier = params.tier_name(body.tier, engine.store.tier_names)  # the remote tier too
    # Blocks of requests that have already answered are flushed too, not stored just after.
    await engine.wait_for_blocks()
    if body.tenant is not None:
        removed = await asyncio.to_thread(_flush_tenant, engine.store, body.tenant)
    else:
        removed = await asyncio.to_thread(engine.store.flush, tier)
    _audit(request, "flush", tier=tier, tenant=body.tenant, removed=removed)
    return web.json_response({"object": "cache.flushed", "tier": tier, "tenant": body.tenant, "removed": removed})


async def warm(request: web.Request) -> web.Response:
    """POST /admin/cache/warm: precompute and store a prompt's blocks without generating."""
    params.query(request)
    body = await params.parse_prompt_body(request, ChatWarmRequest, TextWarmRequest)
    engine, prompt = local_engine(request), _prompt(request, body)
    result = await _naming_messages(body, engine.warm(prompt, pinned=body.pinned, ttl=body.ttl))
    _audit(request, "warm", tenant=prompt.tenant, pinned=body.pinned, ttl=body.ttl, tokens=result.prompt_tokens)
    return web.json_response(
        {
            "object": "cache.warmed",
            "tenant": prompt.tenant,
            "prompt_tokens": result.prompt_tokens,
            "computed_tokens": result.computed_tokens,
            "cached_tokens": result.cached_tokens,
            "pinned": body.pinned,
            "ttl": body.ttl,
        }
    )


async def explain(request: web.Request) -> web.Response:
    """POST /admin/cache/explain: a dry run of a request against the cache, explaining every miss; in front of
    upstreams, which upstream it would go to, and why."""
    params.query(request)
    body = await params.parse_prompt_body(request, ChatExplainRequest, TextExplainRequest)
    engine, prompt = request.config_dict[ENGINE], _prompt(request, body)
    if isinstance(engine, UpstreamEngine):
        routed = await _naming_messages(body, engine.explain(prompt))
        _audit(request, "explain", tenant=prompt.tenant, upstream=routed.route and routed.route.upstream.url)
        return web.json_response(route_explanation_body(routed))
    explanation = await _naming_messages(body, engine.explain(prompt))
    _audit(request, "explain", tenant=prompt.tenant, cached=explanation.cached_tokens)
    return web.json_response(explanation_body(explanation))


async def _to_dashboard(request: web.Request) -> web.StreamResponse:
    # The page finds its data relative to its own address, which must end in a slash.
    raise web.HTTPPermanentRedirect("/admin/")


# -- the guard and the audit log ----------------------------------------------------------------------------------


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse everything when no admin key is set, and every data route without the admin key."""
    admin_key = request.config_dict[SETTINGS].admin_key
    if admin_key is None:
        message = "the admin endpoints are off; start the server with --admin-key (or PREFIXGATE_ADMIN_KEY)"
        return web.json_response(api.error_body(message, "invalid_request_error", code="admin_disabled"), status=403)
    if request.match_info.route.name == "dashboard":
        return await handler(request)  # the page holds no data: every call it makes sends the key
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # compare_digest: the time a comparison takes must not tell how much of a guessed key was right.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), admin_key.encode()):
        log.warning(
            "admin: refused %s %s from %s: %s",
            request.method,
            request.path,
            request.remote,
            "no admin key" if not given else "wrong admin key",
        )
        message = (
            "a valid admin key is required: send 'Authorization: Bearer <admin key>' (API keys do not open /admin)"
        )
        body = api.error_body(message, "invalid_request_error", code="invalid_admin_key")
        return web.json_response(body, status=401, headers={"WWW-Authenticate": 'Bearer realm="prefixgate-admin"'})
    request[ADMIN] = "admin#" + hashlib.sha256(admin_key.encode()).hexdigest()[:8]
    return await handler(request)


def _audit(request: web.Request, action: str, **details: Any) -> None:
    """Log who did what from where: changes to the cache at INFO, reads at DEBUG (the dashboard polls)."""
    level = logging.INFO if request.method in ("POST", "DELETE") else logging.DEBUG
    shown = json.dumps({name: value for name, value in details.items() if value is not None}, sort_keys=True)
    log.log(level, "admin: %s from %s: %s %s", request[ADMIN], request.remote, action, shown)


# -- helpers of the handlers --------------------------------------------------------------------------------------


def _prompt(request: web.Request, body: ExplainRequest) -> PromptRequest:
    """Return the engine's request for a warm or explain body, as the named tenant would send it."""
    served = request.config_dict[ENGINE].model_id
    if body.model != served:
        raise ModelNotServed(body.model, served)
    tenant = params.acting_tenant(body.tenant, sorted(set(request.config_dict[SETTINGS].api_keys.values())))
    return body.to_prompt_request(tenant)


async def _naming_messages(body: ExplainRequest, call: Awaitable[_Result]) -> _Result:
    """Await an engine call; for a chat body, name `messages` where the engine names its `prompt`."""
    try:
        return await call
    except RequestError as error:
        if error.param == "prompt" and isinstance(body, api.ChatCompletionRequest):
            error.param = "messages"
        raise


def upstream_report(engine: UpstreamEngine, prices: ModelPrices | None) -> dict[str, Any]:
    """Return the `/admin/cache` body in front of upstreams: each upstream's state, and the totals."""
    stats = engine.stats.snapshot()
    upstreams = [upstream_state(upstream) for upstream in engine.pool.router.upstreams]
    totals = {
        "requests": stats.requests,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_total,
        **money(prices, stats),
    }
    return {"object": "cache", "model": engine.model_id, "totals": totals, "upstreams": upstreams}


def _tier_names(engine: Engine) -> list[str]:
    return [tier.name for tier in engine.store.tiers]


def _not_found(message: str) -> web.Response:
    return web.json_response(api.error_body(message, "invalid_request_error", code="not_found"), status=404)


# -- store work, run in a worker thread ---------------------------------------------------------------------------


def _inventory(
    store: TieredStore,
) -> tuple[list[TierStats], list[EntryInfo], tuple[RedisStats, RedisUsage | None] | None]:
    remote = store.remote_stats()
    return store.stats(), store.entries(), None if remote is None else (remote, store.remote_usage())


def _read(store: TieredStore, key: BlockKey) -> tuple[list[EntryInfo], Block | None]:
    return store.entry(key), store.read(key)


def _flush_tenant(store: TieredStore, tenant: str) -> int:
    keys = {info.key for info in store.entries(tenant=tenant)}
    return sum(store.delete(key) for key in keys)
