"""The aiohttp app: its factory (the engine made at startup and closed at cleanup), its routes, and the routes that
belong to no face (`/v1/models`, `/health`, `/metrics`). Each face's handlers are in its package (`openai/`,
`anthropic/`, `admin/`); what they share is in `serving`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefixgate.backends import HFBackend
from prefixgate.backends.upstream import UpstreamConfig
from prefixgate.proxy.admin import add_admin
from prefixgate.proxy.anthropic.routes import count_tokens, messages
from prefixgate.proxy.choices import AnyEngine
from prefixgate.proxy.engine import Engine
from prefixgate.proxy.layout import DEFAULT_PATTERNS, DynamicPattern
from prefixgate.proxy.middlewares import MIDDLEWARES, send_request_id
from prefixgate.proxy.openai.responses_routes import responses
from prefixgate.proxy.openai.routes import chat_completions, completions
from prefixgate.proxy.openai.tokenize import detokenize, tokenize
from prefixgate.proxy.serving import ENGINE, METRICS, SETTINGS, engine_for, upstream_state
from prefixgate.proxy.settings import Settings
from prefixgate.proxy.statistics import EngineCollector
from prefixgate.proxy.upstream_engine import UpstreamEngine
from prefixgate.store import BlockLayout, RemoteConfig, StoreConfig, TierConfig, TieredStore
from prefixgate.store.keys import load_or_create_secret
from prefixgate.threads import io_threads

# How the app is served (keyword arguments of aiohttp's run_app, AppRunner and TestServer): a client that disconnects
# cancels its handler, so its request stops at the model's next step, in prefill as in decoding, streamed or not.
SERVE_OPTIONS: dict[str, Any] = {"handler_cancellation": True}
EngineFactory = Callable[[Settings], Awaitable[AnyEngine]]


async def build_engine(settings: Settings) -> AnyEngine:
    """Load the model named in the settings, open the store beside it, and join them in an engine; or, with
    upstreams, an engine in front of them."""
    patterns = (
        tuple(DynamicPattern(name, regex) for name, regex in settings.layout_patterns.items())
        if settings.layout_patterns is not None
        else DEFAULT_PATTERNS
    )
    if settings.upstream:
        # The tenants' salts outlive a restart with the store's secret, so the upstreams' caches stay theirs.
        folder = settings.store
        secret = await asyncio.to_thread(load_or_create_secret, folder) if folder is not None else os.urandom(32)
        configs = [UpstreamConfig(url, settings.upstream_api_keys.get(url)) for url in settings.upstream]
        return await UpstreamEngine.open(
            configs,
            settings.model,
            secret=secret,
            patterns=patterns,
            layout=settings.layout,
            balance=settings.upstream_balance,
            check_interval=settings.upstream_check_interval,
        )
    backend = await asyncio.to_thread(
        HFBackend.load,
        settings.model,
        dtype=None if settings.dtype == "auto" else settings.dtype,
        compile_steps="auto" if settings.compile == "auto" else settings.compile == "on",
        block_size=settings.block_size,
        model_cache_dir=settings.model_cache_dir,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
        interleaved_prefill_tokens=settings.interleaved_prefill_tokens,
        kv_memory_budget=None if settings.kv_memory_budget is None else int(settings.kv_memory_budget),
        max_running=settings.max_running,
        max_waiting=settings.max_waiting,
        kv_buffer_budget=int(settings.kv_buffer_budget),
    )
    geometry = backend.geometry
    try:
        if settings.compile_wait:
            # Before the app has started, so before any request is answered: none meets an eager step.
            await asyncio.to_thread(backend.wait_compiled)
        store = await asyncio.to_thread(
            TieredStore.open,
            settings.store,
            BlockLayout(geometry.block_shape, geometry.dtype),
            store_config(settings, backend.device),
            device=backend.device,
            order=backend.slot_order,
        )
    except BaseException:
        await backend.aclose()
        raise
    return Engine(backend, store, patterns=patterns, layout=settings.layout)


def store_config(settings: Settings, device: torch.device) -> StoreConfig:
    """Return the store's tiers as the settings give them, for a model on `device`."""
    defaults = StoreConfig.defaults(device)
    device_bytes = defaults.device.capacity_bytes if settings.device_budget is None else int(settings.device_budget)
    policy = {"policy": settings.policy, "ttl": settings.ttl, "idle_ttl": settings.idle_ttl}
    remote = (
        RemoteConfig(
            tuple(settings.remote),
            ttl=settings.remote_ttl,
            timeout=settings.remote_timeout,
            queue_bytes=int(settings.remote_queue_budget),
        )
        if settings.remote
        else None
    )
    return StoreConfig(
        device=TierConfig(device_bytes, **policy),  # type: ignore[arg-type]
        host=TierConfig(int(settings.host_budget), **policy),  # type: ignore[arg-type]
        disk=TierConfig(int(settings.disk_budget), **policy),  # type: ignore[arg-type]
        remote=remote,
    )


def create_app(settings: Settings, engine_factory: EngineFactory = build_engine) -> web.Application:
    """Build the app; the engine is made by `engine_factory` at startup and closed at cleanup."""
    app = web.Application(client_max_size=int(settings.max_body_bytes), middlewares=MIDDLEWARES)
    app[SETTINGS] = settings
    app.on_response_prepare.append(send_request_id)

    async def engine_context(app: web.Application) -> AsyncIterator[None]:
        app[ENGINE] = await engine_factory(settings)
        app[METRICS] = _metrics_registry(app[ENGINE], settings)
        io_threads(asyncio.get_running_loop())  # the model is loaded
        yield
        await app[ENGINE].close()

    app.cleanup_ctx.append(engine_context)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)  # a model id may hold a slash: "org/name"
    app.router.add_post("/tokenize", tokenize)  # vLLM's, beside the OpenAI routes
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_admin(app)
    return app


# -- the routes of no face ----------------------------------------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    """GET /v1/models."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[ENGINE])]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the one model this server serves, or 404 (the `openai` client's models.retrieve)."""
    return web.json_response(_model_card(engine_for(request, request.match_info["model"])))


async def health(request: web.Request) -> web.Response:
    """GET /health: "ok"; "degraded" while a store tier fails (naming it and its last error), the remote tier, or
    some upstream, does not answer (requests go on without it); 503 "unavailable" once the model has stopped, or
    while no upstream answers."""
    engine = request.app[ENGINE]
    if isinstance(engine, UpstreamEngine):
        return _upstream_health(engine)
    body: dict[str, Any] = {
        "status": "ok",
        "model": engine.backend.model_id,
        "prefix_reuse": engine.backend.prefix_reuse,
        "steps": engine.backend.steps,
    }
    problem = engine.backend.problem()
    if problem is not None:
        return web.json_response(body | {"status": "unavailable", "problem": problem}, status=503)
    failing = {tier.name: tier.problem for tier in engine.store.tiers if tier.problem is not None}
    if failing:  # requests are still served, from the other tiers and the model
        body |= {"status": "degraded", "tiers": failing}
    remote = engine.store.remote
    if remote is not None:
        available = await asyncio.to_thread(remote.check)
        body["remote"] = {"url": remote.url, "available": available}
        if not available:  # requests are still served, from the local tiers and the model
            body["status"] = "degraded"
    return web.json_response(body)


def _upstream_health(engine: UpstreamEngine) -> web.Response:
    """Each upstream's state; "degraded" while some are out of rotation, 503 "unavailable" while all are."""
    upstreams = [upstream_state(upstream) for upstream in engine.pool.router.upstreams]
    healthy = sum(state["available"] for state in upstreams)
    status = "ok" if healthy == len(upstreams) else "degraded" if healthy else "unavailable"
    body = {"status": status, "model": engine.model_id, "upstreams": upstreams}
    return web.json_response(body, status=503 if status == "unavailable" else 200)


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics, in Prometheus text format."""
    # Off the loop: a scrape reads the store's tiers, and that touches LMDB.
    body = await asyncio.to_thread(generate_latest, request.app[METRICS])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _metrics_registry(engine: AnyEngine, settings: Settings) -> CollectorRegistry:
    """Return a registry of the app's own that reads the engine's statistics at each scrape."""
    # One per app, not prometheus_client's process-wide default: several apps in one process each report their own.
    registry = CollectorRegistry()
    if isinstance(engine, UpstreamEngine):
        collector = EngineCollector(
            engine.stats,
            model_name=engine.model_id,
            upstreams=lambda: engine.pool.router.upstreams,
            tenants=settings.metrics_tenants,
            prices=settings.prices.get(engine.model_id),
        )
    else:
        collector = EngineCollector(
            engine.stats,
            engine.store.stats,
            engine.backend.admission,
            model_name=engine.model_id,
            remote=engine.store.remote_stats,
            tenants=settings.metrics_tenants,
            prices=settings.prices.get(engine.model_id),
        )
    registry.register(collector)
    return registry


def _model_card(engine: AnyEngine) -> dict[str, Any]:
    card = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "prefixgate"}
    if engine.context_length is None:  # upstreams that do not say theirs
        return card
    return card | {"context_length": engine.context_length, "max_model_len": engine.context_length}  # vLLM's name
