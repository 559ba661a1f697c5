"""The engine on the tiny Llama: one pipeline, single flight for shared uncached prefixes, namespaces per tenant."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import (
    EMBEDDED_MODEL,
    HFBackend,
    KVReservation,
    PrefixStart,
    SamplingParams,
    StepRecord,
    cpu_attention,
)
from prefixgate.backends import attention as attention_module
from prefixgate.backends.kv_cache import geometry_from_config
from prefixgate.proxy import engine as engine_module
from prefixgate.proxy.engine import Breakpoint, Engine, PreparedPrompt, PromptRequest, Retained
from prefixgate.proxy.settings import load_settings
from prefixgate.store import Block, BlockKey, BlockLayout, StoreConfig, TierConfig, TieredStore, shared_prefix
from prefixgate.store.memory_tier import MemoryTier
from tests.backends.tiny_models import make_llama
from tests.proxy.conftest import HANG_GUARD_SECONDS, HeldSteps, on_event_loop, tiny_engine

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
    return sum(step.tokens("prefill") for step in steps)


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


async def test_each_request_runs_in_the_buffer_it_reserved_cold_or_warm(
    engine_and_steps: tuple[Engine, list[StepRecord]],
) -> None:
    engine, _ = engine_and_steps
    reserve = engine.backend.reserve
    reserved: list[KVReservation] = []

    async def recorded_reserve(prompt_tokens: int, max_tokens: int, **options: Any) -> KVReservation:
        reserved.append(await reserve(prompt_tokens, max_tokens, **options))
        return reserved[-1]

    engine.backend.reserve = recorded_reserve  # type: ignore[method-assign]
    buffers = []
    for _ in range(2):
        generation = await engine.generate(chat("Hello there"))
        buffer = reserved[-1].buffer
        assert buffer is not None
        buffers.append(buffer.data_ptr())
        async with generation:
            _ = [chunk async for chunk in generation]
    assert generation.usage().cached_tokens > 0
    # The cold request ran in its reserved buffer and gave it back, so the warm one fetched into that same memory,
    # already used; when a request ends its reservation holds nothing and admission counts nothing.
    assert buffers[0] == buffers[1]
    assert all(r.buffer is None for r in reserved)
    assert engine.backend.admission().bytes_in_use == 0


@pytest.mark.parametrize(("budget", "kept"), [("1MiB", True), ("0", False)])
async def test_kv_buffer_budget_bounds_the_buffers_kept_for_reuse(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, budget: str, kept: bool
) -> None:
    engine = tiny_engine(load_settings(store=tmp_path / "store", kv_buffer_budget=budget), tokenizer, llama, [])
    try:
        first = await engine.backend.reserve(100, 4)  # 256 tokens of the tiny model's KV: 64 KiB
        buffer = first.buffer  # held here, so its memory cannot come back as a new buffer's
        assert buffer is not None
        first.release()
        second = await engine.backend.reserve(100, 4)
        assert second.buffer is not None and (second.buffer.data_ptr() == buffer.data_ptr()) == kept
        second.release()
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


class FullDisk(TieredStore):
    """A store whose every put fails, as one on a full or failing device would."""

    def put(self, blocks: Sequence[Block], **keep: Any) -> int:
        raise OSError(28, "No space left on device")


async def test_a_block_the_store_fails_to_keep_is_logged_counted_and_releases_its_waiters(
    engine_and_steps: tuple[Engine, list[StepRecord]], caplog: pytest.LogCaptureFixture
) -> None:
    engine, _ = engine_and_steps
    engine.store.__class__ = FullDisk
    long_answer = replace(chat("Tell me a story"), params=SamplingParams(max_tokens=300, temperature=0.0))
    first = await engine.generate(long_answer)
    await anext(first)  # its prompt's blocks went to the store, which failed to keep them
    # A second request for the same prompt waited for those blocks; it now computes them itself while the first
    # still runs, instead of waiting for the first to end.
    second = await asyncio.wait_for(engine.complete(chat("Tell me a story")), 300)
    assert second.usage.cached_tokens == 0
    assert engine.stats.store_errors > 0
    assert "could not store block" in caplog.text and "No space left on device" in caplog.text
    await first.aclose()


async def test_every_step_of_preparing_a_prompt_runs_off_the_event_loop(
    engine_and_steps: tuple[Engine, list[StepRecord]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = engine_and_steps
    on_loop: dict[str, list[bool]] = {}

    def recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            on_loop.setdefault(name, []).append(on_event_loop())
            return function(*args, **kwargs)

        return call

    for name in ("check_prompt_size", "canonicalize_messages", "canonicalize_text", "lay_out", "explain_prompt"):
        monkeypatch.setattr(engine_module, name, recorded(name, getattr(engine_module, name)))
    for name in ("render_chat", "render_text"):
        monkeypatch.setattr(engine.backend, name, recorded(name, getattr(engine.backend, name)))
    await engine.prepare(chat("What is 2 + 2?"))
    await engine.prepare(PromptRequest(params=GREEDY, prompt="2 + 2 ="))
    await engine.explain(chat("What is 2 + 2?"))
    assert on_loop == {
        "check_prompt_size": [False] * 3,
        "canonicalize_messages": [False] * 3,  # explain canonicalizes once more, to show what changed
        "canonicalize_text": [False],
        "lay_out": [False] * 2,
        "render_chat": [False] * 2,
        "render_text": [False],
        "explain_prompt": [False],
    }


async def test_a_request_right_after_the_one_that_computed_its_prefix_waits_for_those_blocks_to_be_filed(
    engine_and_steps: tuple[Engine, list[StepRecord]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _ = engine_and_steps
    store = engine.store
    filed, looked = threading.Event(), threading.Event()
    put, held = store.put, store.held

    def slow_put(blocks: Sequence[Block], **keep: Any) -> int:
        filed.wait(HANG_GUARD_SECONDS)  # the filer is behind: nothing is stored until the test lets it go
        return put(blocks, **keep)

    def watched_held(*args: Any) -> Any:
        found = held(*args)
        looked.set()
        return found

    monkeypatch.setattr(store, "put", slow_put)
    monkeypatch.setattr(store, "held", watched_held)
    first = await engine.complete(chat("What is the capital of France?"))  # ended; its blocks wait for the filer
    looked.clear()
    second = asyncio.create_task(engine.complete(chat("What is the capital of France?")))
    assert await asyncio.to_thread(looked.wait, HANG_GUARD_SECONDS)  # it looked, and found nothing stored yet
    filed.set()
    assert (await second).usage.cached_tokens == first.usage.prompt_tokens - 1  # it waited for them


def test_each_block_is_kept_by_the_longest_breakpoint_covering_it_and_writes_count_full_blocks_once() -> None:
    prepared = PreparedPrompt(
        token_ids=tuple(range(143)),
        namespace=None,  # type: ignore[arg-type]  # not read here
        keys=(),
        reusable=17,
        moved=(),
        messages=None,
        tenant="",
        retained=(Retained(83, 3600.0), Retained(120, 300.0), Retained(5, 86400.0)),
    )
    assert [prepared.retention(block, 8) for block in (0, 9, 10, 14, 15)] == [3600.0, 3600.0, 300.0, 300.0, None]
    # Blocks 2..9 (after the 16 cached tokens) under the hour, 10..14 under five minutes; token 83 is in block 10.
    assert prepared.cache_writes(16, 8) == {3600.0: 64, 300.0: 40}
    assert prepared.cache_writes(128, 8) == {}


def test_a_breakpoint_cuts_the_request_after_its_message_part_or_tool() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    request = PromptRequest(
        params=SamplingParams(),
        messages=[{"role": "system", "content": parts}, {"role": "user", "content": "hi"}],
        tools=[{"name": "a"}, {"name": "b"}],
    )
    cut = Breakpoint(300.0, message=0, part=0).cut(request)
    assert cut is not None and cut.messages == [{"role": "system", "content": parts[:1]}] and cut.tools == request.tools
    cut = Breakpoint(300.0, message=1).cut(request)
    assert cut is not None and cut.messages == request.messages
    cut = Breakpoint(300.0, tool=0).cut(request)
    assert cut is not None and cut.tools == [{"name": "a"}] and cut.messages == []
    assert Breakpoint(300.0).cut(request) is None  # the whole prompt
    assert request.messages is not None and request.messages[0]["content"] == parts  # the request is left alone


@pytest.mark.smollm2
async def test_a_follow_up_turn_reuses_the_previous_prompt_and_answer_up_to_the_first_token_that_differs() -> None:
    # In float32: the reused and the fresh prompt round differently, and bfloat16 logits tie often enough (21.5 and
    # 21.5 at the eighth token of this answer) for greedy tokens to part where the reuse is right.
    backend = HFBackend.load(EMBEDDED_MODEL, dtype=torch.float32, compile_steps=False)
    geometry = backend.geometry
    budget = TierConfig(256 << 20)
    store = TieredStore.open(
        None, BlockLayout(geometry.block_shape, geometry.dtype), StoreConfig(TierConfig(0), budget, TierConfig(0))
    )
    engine = Engine(backend, store)
    try:
        system = {"role": "system", "content": "You are a travel guide. " + "Answer in two sentences. " * 30}
        turn = [system, {"role": "user", "content": "What should I see in Paris?"}]
        greedy = SamplingParams(max_tokens=40, temperature=0.0)
        first = await engine.generate(PromptRequest(greedy, messages=turn))
        async with first:
            answer = [chunk async for chunk in first]
        await engine.wait_for_blocks()
        reply = "".join(chunk.text for chunk in answer)
        follow_up = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "And in Rome?"}]
        second = await engine.generate(PromptRequest(greedy, messages=follow_up))
        async with second:
            reused = [chunk.token_id async for chunk in second]
        # The cache holds the first prompt and its answer (all but the answer's last token): whole blocks and a tail.
        held = [*first.prepared.token_ids, *(chunk.token_id for chunk in answer[:-1])]
        expected = shared_prefix(held, second.prepared.token_ids)
        assert second.cached_tokens == expected > len(first.prepared.token_ids)
        assert expected % geometry.block_size  # not at a block boundary: reuse to the token
        await asyncio.to_thread(store.flush)
        alone = await engine.generate(PromptRequest(greedy, messages=follow_up))
        async with alone:
            assert [chunk.token_id async for chunk in alone] == reused and alone.cached_tokens == 0
    finally:
        await engine.close()


async def test_warm_arrivals_at_once_read_one_copy_of_their_prefix_filled_once_and_answer_as_alone(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = HeldSteps()
    engine = tiny_engine(load_settings(store=tmp_path / "store"), tokenizer, llama, steps, min_shared_tokens=16)
    questions = [f"Question {index}: what is the capital of France?" for index in range(4)]
    try:
        alone = [await engine.complete(chat(question)) for question in questions]
        # Each cached its whole prompt: the system prompt's blocks now fork into four questions.
        fills: list[tuple[int, int]] = []  # the blocks each fill fetched: from, to
        loaded = 0
        all_loaded = asyncio.Event()
        fill, load = engine._fill, engine._load

        def counting_fill(prepared: PreparedPrompt, start: PrefixStart) -> None:
            fills.extend((prefix.first_block, prefix.blocks) for prefix in start.fills)
            fill(prepared, start)

        async def counting_load(*args: Any) -> Any:
            nonlocal loaded
            hit = await load(*args)
            loaded += 1
            if loaded == len(questions):
                all_loaded.set()
            return hit

        monkeypatch.setattr(engine, "_fill", counting_fill)
        monkeypatch.setattr(engine, "_load", counting_load)
        steps.hold_kind = "prefill"  # the first to run waits, holding the prefix, until every arrival has its own
        together = asyncio.gather(*(engine.complete(chat(question)) for question in questions))
        await steps.held()
        await asyncio.wait_for(all_loaded.wait(), HANG_GUARD_SECONDS)
        assert engine.backend.admission().shared_prefixes == len(fills)
        host = engine.store.tiers[0]
        assert isinstance(host, MemoryTier) and host.lent() == sum(end - start for start, end in fills)
        steps.released.set()
        answers = await together
        assert [answer.text for answer in answers] == [answer.text for answer in alone]
        system_blocks = shared_prefix(*[(await engine.prepare(chat(q))).token_ids for q in questions[:2]]) // 8
        # One copy of the system prompt, up to where the questions depart, filled once; each question's own cached
        # blocks after it are a prefix of their own, read on from that one.
        assert sorted(fills)[0] == (0, system_blocks)
        assert all(start == system_blocks for start, _ in sorted(fills)[1:])
        # The rest of each prompt, its question's blocks and the last one's leading tokens, came from the store.
        assert [answer.usage.cached_tokens for answer in answers] == [a.usage.prompt_tokens - 1 for a in alone]
        stats = engine.backend.admission()
        assert (stats.shared_prefixes, stats.bytes_in_use, stats.running, host.lent()) == (0, 0, 0, 0)
    finally:
        steps.released.set()
        await engine.close()


async def test_a_flush_while_requests_read_a_shared_prefix_changes_no_answer(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel
) -> None:
    steps = HeldSteps()
    block = geometry_from_config(llama.config, llama.dtype, 8)
    settings = load_settings(store=tmp_path / "store", host_budget=64 * block.block_nbytes)
    engine = tiny_engine(settings, tokenizer, llama, steps, min_shared_tokens=16)
    questions = ["What is the capital of France?", "What is the capital of Italy?"]
    try:
        expected = [await engine.complete(chat(question)) for question in questions]  # computed, then cached
        steps.hold_kind = "decode"  # both are decoding from the shared prefix when the model thread stops
        together = asyncio.gather(*(engine.complete(chat(question)) for question in questions))
        await steps.held()
        host = engine.store.tiers[0]
        assert isinstance(host, MemoryTier) and host.name == "host"
        lent = host.lent()
        assert engine.backend.admission().shared_prefixes >= 1 and lent > 0  # read in place, where the tier holds it
        assert await asyncio.to_thread(engine.store.flush) > 0  # every block the prefix was read from is gone
        # Other blocks fill the tier meanwhile: none takes the memory the prefix is read from.
        junk = [
            Block(BlockKey(os.urandom(16)), tuple(range(8)), torch.randn(block.block_shape), tenant="junk")
            for _ in range(64)
        ]
        await asyncio.to_thread(engine.store.put, junk)
        assert len(host) == 64 - lent
        steps.released.set()
        answers = await together
        assert [answer.text for answer in answers] == [answer.text for answer in expected]
        assert all(answer.usage.cached_tokens > 0 for answer in answers)
        assert engine.backend.admission().shared_prefixes == 0 and host.lent() == 0
    finally:
        steps.released.set()
        await engine.close()


async def test_a_store_in_the_kernels_order_lends_prefixes_the_steps_read_where_they_lie_and_answers_as_in_token_order(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = cpu_attention.slot_order(torch.bfloat16, 64, 32)
    if order is None:
        pytest.skip("the C kernel reads lent prefixes in token order here: its build packs none, or it does not run")
    model = make_llama(tokenizer, head_dim=64, seed=1).to(torch.bfloat16)  # heads of 64: the bfloat16 kernel's
    lay_out, tiled = attention_module._kernel_layout, []

    def recorded(batch: attention_module.PackedBatch) -> cpu_attention.StepLayout:
        if batch.shared:
            tiled.append(batch.shared_tiled)
        return lay_out(batch)

    monkeypatch.setattr(attention_module, "_kernel_layout", recorded)
    questions = [f"Question {index}: what is the capital of France?" for index in range(3)]
    answers = {}
    for ordered in (False, True):
        backend = HFBackend(model, tokenizer, model_id="tiny-llama", block_size=32, min_shared_tokens=64)
        assert backend.slot_order == order
        with pytest.raises(ValueError, match="do not read"):
            backend.reads_lent_in(object())  # type: ignore[arg-type]
        geometry = backend.geometry
        tiers = StoreConfig(TierConfig(0), TierConfig(64 * geometry.block_nbytes), TierConfig(1 << 30))
        store = TieredStore.open(
            tmp_path / str(ordered),
            BlockLayout(geometry.block_shape, geometry.dtype),
            tiers,
            order=order if ordered else None,
        )
        engine = Engine(backend, store)
        try:
            await engine.complete(chat(questions[0]))  # computed, then cached
            await engine.wait_for_blocks()
            tiled.clear()
            together = await asyncio.gather(*(engine.complete(chat(question)) for question in questions))
            await asyncio.to_thread(store.flush, "host")  # from disk (in token order) to the host tier, laid out again
            again = await asyncio.gather(*(engine.complete(chat(question)) for question in questions))
            assert tiled and set(tiled) == {ordered}  # steps read lent prefixes, in the store's order
            assert all(answer.usage.cached_tokens > 64 for answer in together + again)
            answers[ordered] = [answer.text for answer in together + again]
        finally:
            await engine.close()
    assert answers[True] == answers[False]
