"""Fixtures for proxy tests: the real app over an engine on the tiny random-weight Llama, in this process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiohttp.web_runner import AppRunner, BaseRunner
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, StepRecord
from prefixgate.proxy.app import SERVE_OPTIONS, create_app, store_config
from prefixgate.proxy.engine import Engine
from prefixgate.proxy.serving import ENGINE
from prefixgate.proxy.settings import Settings, load_settings
from prefixgate.store import BlockLayout, TieredStore
from tests.backends.tiny_models import make_llama, make_tokenizer

MODEL = "tiny-llama"
BLOCK_SIZE = 8
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 6


def chat_body(
    content: str = "What is the capital of France?", *, system: str = SYSTEM, max_tokens: int = 8, **fields: Any
) -> dict[str, Any]:
    """Return a greedy chat completions body: a system prompt and one user message, plus any other fields."""
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    } | fields


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    return make_llama(tokenizer, max_position_embeddings=1024)


def tiny_engine(
    settings: Settings,
    tokenizer: PreTrainedTokenizerFast,
    model: PreTrainedModel,
    steps: list[StepRecord],
    **backend_options: Any,
) -> Engine:
    """Return an engine on the tiny Llama (8-token blocks, 16-token prefill chunks) and the settings' store."""
    backend = HFBackend(
        model,
        tokenizer,
        model_id=MODEL,
        block_size=BLOCK_SIZE,
        prefill_chunk_tokens=16,
        interleaved_prefill_tokens=settings.interleaved_prefill_tokens,
        kv_memory_budget=None if settings.kv_memory_budget is None else int(settings.kv_memory_budget),
        max_running=settings.max_running,
        max_waiting=settings.max_waiting,
        kv_buffer_budget=int(settings.kv_buffer_budget),
        on_step=steps.append,
        **backend_options,
    )
    geometry = backend.geometry
    config = store_config(settings, backend.device)
    store = TieredStore.open(settings.store, BlockLayout(geometry.block_shape, geometry.dtype), config)
    return Engine(backend, store, layout=settings.layout)


Serve = Callable[..., Awaitable[TestClient[Any, Any]]]

HANG_GUARD_SECONDS = 60  # only a broken build waits this long


class HeldSteps(list[StepRecord]):
    """Record each model step; hold the model thread after the first step of a chosen kind (in which at least
    `hold_sequences` sequences compute that kind) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_kind: str | None = None
        self.hold_sequences = 1
        self.reached = threading.Event()
        self.released = threading.Event()

    def append(self, record: StepRecord) -> None:
        super().append(record)
        held = sum(work.kind == self.hold_kind and work.tokens > 0 for work in record.work) >= self.hold_sequences
        if self.hold_kind is not None and held and not self.reached.is_set():
            self.reached.set()
            assert self.released.wait(HANG_GUARD_SECONDS), "the test never released the model thread"

    async def held(self) -> int:
        """Wait until the model thread is held; return the steps run so far."""
        assert await asyncio.to_thread(self.reached.wait, HANG_GUARD_SECONDS), "no step of that kind ran"
        return len(self)


class ServedApp(TestServer):
    """The test server, run with the options `prefixgate serve` runs the app with, not aiohttp's test defaults."""

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        kwargs.pop("handler_cancellation", None)  # TestServer always turns it on; `prefixgate serve` decides
        return AppRunner(self.app, **kwargs, **SERVE_OPTIONS)


@pytest.fixture
def steps() -> list[StepRecord]:
    """Every model step the served engine runs, in order."""
    return []


@pytest.fixture
async def serve(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, steps: list[StepRecord]
) -> AsyncIterator[Serve]:
    """Start the real app on a local port; settings are keyword arguments, as the CLI flags would give them."""
    clients: list[TestClient[Any, Any]] = []

    async def start(**overrides: Any) -> TestClient[Any, Any]:
        overrides.setdefault("store", tmp_path / "store")
        overrides.setdefault("model", MODEL)
        settings = load_settings(**overrides)

        async def factory(settings: Settings) -> Engine:
            return tiny_engine(settings, tokenizer, llama, steps)

        client: TestClient[Any, Any] = TestClient(ServedApp(create_app(settings, factory)))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


def on_event_loop() -> bool:
    """Say whether the caller runs on the event loop's thread, inside the loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def engine_of(client: TestClient[Any, Any]) -> Engine:
    """Return the engine behind a test client's app."""
    return client.server.app[ENGINE]  # type: ignore[union-attr]


def metric_families(text: str) -> dict[str, Metric]:
    """Parse `/metrics` text as Prometheus does: its metric families by name (a counter's without `_total`)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Metric], name: str, **labels: str) -> float:
    """Return the value of the one sample called `name` whose labels include `labels`."""
    values = [
        found.value
        for family in families.values()
        for found in family.samples
        if found.name == name and labels.items() <= found.labels.items()
    ]
    assert len(values) == 1, f"{len(values)} samples named {name} with labels {labels}"
    return values[0]


async def scrape(client: TestClient[Any, Any]) -> dict[str, Metric]:
    """GET /metrics from the app and parse it."""
    response = await client.get("/metrics")
    assert response.status == 200 and response.headers["Content-Type"] == CONTENT_TYPE_LATEST
    return metric_families(await response.text())
