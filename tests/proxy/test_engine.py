"""The engine on the tiny Llama: one pipeline, single flight for shared uncached prefixes, namespaces per tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import SamplingParams, StepRecord
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.settings import load_settings
from tests.proxy.conftest import tiny_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 8


def chat(question: str, **fields: object) -> PromptRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return PromptRequest(params=GREEDY, messages=messages, **fields)  # type: ignore[arg-type]


@pytest.fixture
async def engine_and_steps(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel
) -> AsyncIterator[tuple[Engine, list[StepRecord]]]:
    steps: list[StepRecord] = []
    engine = tiny_engine(load_settings(store=tmp_path / "store"), tokenizer, llama, steps)
    yield engine, steps
    await engine.close()


def prefill_tokens(steps: list[StepRecord]) -> int:
    return sum(step.tokens for step in steps if step.kind == "prefill")


async def test_concurrent_requests_sharing_an_uncached_prefix_compute_it_once(
    engine_and_steps: tuple[Engine, list[StepRecord]],
) -> None:
    engine, steps = engine_and_steps
    prompt_tokens = len((await engine.prepare(chat("What is the capital of France?"))).token_ids)
    first, second = await asyncio.gather(
        engine.complete(chat("What is the capital of France?")), engine.complete(chat("What is the capital of France?"))
    )
    # The second waited for the first's blocks: together they computed the prompt once, plus the second's last
    # partial block (it can never reuse its final token).
    assert prefill_tokens(steps) < prompt_tokens + 16
    assert min(first.usage.cached_tokens, second.usage.cached_tokens) == 0
    assert max(first.usage.cached_tokens, second.usage.cached_tokens) >= prompt_tokens - 16
    assert first.text == second.text


async def test_a_request_alone_computes_its_whole_prompt(engine_and_steps: tuple[Engine, list[StepRecord]]) -> None:
    engine, steps = engine_and_steps
    completion = await engine.complete(chat("Hello there"))
    assert completion.usage.cached_tokens == 0
    assert prefill_tokens(steps) == completion.usage.prompt_tokens


async def test_each_request_runs_in_the_buffer_it_was_lent_cold_or_warm(
    engine_and_steps: tuple[Engine, list[StepRecord]],
) -> None:
    engine, _ = engine_and_steps
    lend = engine.backend.kv_buffer
    lent: list[torch.Tensor | None] = []

    def recorded_lend(prompt_tokens: int, max_tokens: int) -> torch.Tensor | None:
        lent.append(lend(prompt_tokens, max_tokens))
        return lent[-1]

    engine.backend.kv_buffer = recorded_lend  # type: ignore[method-assign]
    cold = await engine.complete(chat("Hello there"))
    warm = await engine.complete(chat("Hello there"))
    assert cold.usage.cached_tokens == 0 < warm.usage.cached_tokens
    # Nothing was fetched into the cold request's buffer: its job ran in it all the same, and gave it back, so the
    # warm request was lent that same memory, already used, and so is the next one.
    assert lent[0] is not None and lent[1] is lent[0]
    assert lend(cold.usage.prompt_tokens, 4) is lent[0]


@pytest.mark.parametrize(("budget", "kept"), [("1MiB", True), ("0", False)])
async def test_kv_buffer_budget_bounds_the_buffers_kept_for_reuse(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, budget: str, kept: bool
) -> None:
    engine = tiny_engine(load_settings(store=tmp_path / "store", kv_buffer_budget=budget), tokenizer, llama, [])
    try:
        lent = engine.backend.kv_buffer(100, 4)  # 256 tokens of the tiny model's KV: 64 KiB
        assert lent is not None
        engine.backend.return_kv_buffer(lent)
        assert (engine.backend.kv_buffer(100, 4) is lent) == kept
    finally:
        await engine.close()


async def test_tenants_and_cache_salts_have_their_own_namespaces(
    engine_and_steps: tuple[Engine, list[StepRecord]],
) -> None:
    engine, _ = engine_and_steps
    names = {
        engine.namespace("acme"),
        engine.namespace("globex"),
        engine.namespace("acme", "x"),
        engine.namespace("acme:x"),  # a separator in a name cannot forge another tenant's salt
    }
    assert len(names) == 4
    await engine.complete(chat("Hi", tenant="acme"))
    assert (await engine.complete(chat("Hi", tenant="acme"))).usage.cached_tokens > 0
    assert (await engine.complete(chat("Hi", tenant="globex"))).usage.cached_tokens == 0


async def test_stats_count_requests_tokens_and_cached_tokens_per_tier(
    engine_and_steps: tuple[Engine, list[StepRecord]],
) -> None:
    engine, _ = engine_and_steps
    first = await engine.complete(chat("Count me"))
    second = await engine.complete(chat("Count me"))
    assert engine.stats.requests == 2
    assert engine.stats.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert engine.stats.cached_tokens == {"host": second.usage.cached_tokens}
    assert engine.stats.completion_tokens == first.usage.completion_tokens + second.usage.completion_tokens
