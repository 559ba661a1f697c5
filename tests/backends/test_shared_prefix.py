"""Shared prefixes: running requests read one copy of a cached prefix in place, attended once per step.

The reference is always the unshared path: the same prompt computed in one buffer of its own. Fills here lend views of
one tensor holding the blocks a first generation handed back, as the engine's fill lends views of the store's top
tier (`tests/proxy/test_engine.py` runs that whole path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, KVReservation, SamplingParams, TokenChunk, cpu_attention
from prefixgate.backends import attention as attention_module
from prefixgate.backends.kv_cache import sharing_refusal
from prefixgate.backends.model_runner import ModelRunner, StepInput
from tests.backends.conftest import BackendFactory
from tests.backends.streams import GREEDY, BlockSink, collect, transformers_attention
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.test_model_families import FAMILIES
from tests.backends.tiny_models import make_mistral

BLOCK = 8
IDS = [f"block-{i}" for i in range(64)]  # chain ids of the shared blocks: the same ids, the same prefix


def shared_backend(make_backend: BackendFactory, **options: object) -> HFBackend:
    """Return a backend that shares prefixes of two blocks or more (the default asks for 256 tokens)."""
    return make_backend(min_shared_tokens=2 * BLOCK, **options)


async def start_shared(
    backend: HFBackend,
    prompt: Sequence[int],
    blocks: Sequence[torch.Tensor],
    max_tokens: int = GREEDY.max_tokens,
    forks: Sequence[int] = (),
) -> KVReservation:
    """Start `prompt` from a shared prefix of `blocks`, filling it (as the engine does) if new, and reserve for it."""
    start = backend.start_prefix(IDS[: len(blocks)], forks)
    while start is not None and (fill := start.fill) is not None:
        kv = torch.cat(list(blocks[fill.first_block : fill.blocks]), dim=3)  # kv: [layers, 2, kv_heads, n, head_dim]
        start.filled(kv.split(3 * BLOCK, dim=3), ["host"] * (fill.blocks - fill.first_block), lambda: None)
    reservation = await backend.reserve(len(prompt), max_tokens, start=start)
    await reservation.settle()
    return reservation


async def run_shared(
    backend: HFBackend, prompt: Sequence[int], blocks: Sequence[torch.Tensor], params: SamplingParams = GREEDY
) -> list[int]:
    """Generate `prompt` from a shared prefix of `blocks`; return the token ids."""
    reservation = await start_shared(backend, prompt, blocks, params.max_tokens)
    stream = backend.generate(prompt, [], params, reservation=reservation)
    return [chunk.token_id async for chunk in stream]


async def a_prompt_and_its_blocks(
    make_backend: BackendFactory, length: int
) -> tuple[HFBackend, list[int], list[torch.Tensor], list[int]]:
    """Return a sharing backend, a prompt of `length` tokens, its blocks, and its greedy tokens computed alone."""
    backend = shared_backend(make_backend)
    prompt = make_prompt(length)
    blocks = await prefix_blocks(backend, prompt)
    return backend, prompt, blocks, (await collect(backend, prompt)).token_ids


async def prefix_blocks(backend: HFBackend, prompt: Sequence[int]) -> list[torch.Tensor]:
    """Return the blocks of `prompt` as a generation hands them back."""
    sink = BlockSink()
    await collect(backend, prompt, on_block=sink)
    return sink.blocks


SHARING = sorted(name for name, build in FAMILIES.items() if sharing_refusal(build(400).config) is None)


def test_the_families_that_share_are_those_without_windows_or_soft_capping() -> None:
    assert SHARING == ["llama", "phi3", "qwen3"]
    for name in sorted(set(FAMILIES) - set(SHARING)):  # Mistral, Qwen2 mixed, Gemma 2 and 3: each copies
        refusal = sharing_refusal(FAMILIES[name](400).config)
        assert refusal is not None and ("sliding_attention" in refusal or "soft-caps" in refusal), (name, refusal)


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test's float32 packed steps with the C kernel (skipped where it does not run), then with torch's
    kernels."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_attention, "_library", lambda dtype: None)
    elif not cpu_attention.prepare(torch.float32):
        pytest.skip("the C kernel does not run here in float32")
    return str(request.param)


@pytest.mark.parametrize("family", SHARING)
def test_shared_prefixes_give_the_logits_of_one_buffer_for_prefill_chunks_and_decode_nested_or_not(
    family: str,
    attention_path: str,
    make_backend: BackendFactory,
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = FAMILIES[family](len(tokenizer))
    geometry = make_backend(model).geometry  # the backend packs the model's attention
    runner = ModelRunner(model)
    prompt = make_prompt(60)
    shape = (geometry.layers, 2, geometry.kv_heads, 64, geometry.head_dim)
    with torch.inference_mode(), transformers_attention(model):
        expected = model(torch.tensor([prompt])).logits[0].float()  # expected: [60, vocab]
    with torch.inference_mode():
        whole = torch.zeros(shape)
        runner.run([StepInput(prompt[:32], whole, 0)])  # the unshared path fills the prefixes' K and V
    root, document = whole[:, :, :, :16].clone(), whole[:, :, :, 16:32].clone()  # a system prompt, a document
    # With torch's kernels: its CPU flash kernel, then the plain matrix products other devices run.
    for exact in (False, True) if attention_path == "torch" else (False,):
        if exact:
            monkeypatch.setattr(attention_module, "attend_with_lse", attention_module._attend_exactly)
        nested, shallow, alone = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        shallow[:, :, :, :16] = document
        alone[:, :, :, :32] = whole[:, :, :, :32]
        with torch.inference_mode():
            # Prefill chunks of three requests at once: two levels read in place, one level and a copy, no sharing.
            for begin, end in ((32, 45), (45, 59)):
                logits = runner.run(
                    [
                        StepInput(prompt[begin:end], nested, begin, 32, (root, document)),
                        StepInput(prompt[begin:end], alone, begin),
                        StepInput(prompt[begin:end], shallow, begin, 16, (root,)),
                    ]
                )
                for row in logits:
                    torch.testing.assert_close(row, expected[end - 1], atol=1e-4, rtol=0)
            # A decode step of each, the shared rows not side by side.
            logits = runner.run(
                [
                    StepInput(prompt[59:60], nested, 59, 32, (root, document)),
                    StepInput(prompt[59:60], alone, 59),
                    StepInput(prompt[59:60], shallow, 59, 16, (root,)),
                ]
            )
        for row in logits:
            torch.testing.assert_close(row, expected[59], atol=1e-4, rtol=0)


def test_a_long_prefix_attended_in_halves_gives_what_one_call_gives() -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 1536, 16)  # kv: [2, kv_heads, tokens, head_dim], long enough to be cut in halves
    grouped = torch.randn(1, 3, 12, 16)  # grouped: [1, kv_heads, rows, head_dim]
    parts, part_lses = attention_module._attend_prefix(grouped, kv, 0.25)
    assert parts.shape[0] == 2  # halves
    out, lse = attention_module._merge(parts, part_lses)
    expected, expected_lse = attention_module._attend_exactly(grouped, kv[0:1], kv[1:2], None, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)


def test_exact_attention_holds_a_slice_of_the_scores_at_a_time_and_gives_what_all_at_once_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, seen, length = 6, 2, 16, 40, 7  # three query heads read each KV head
    query = torch.randn(1, heads, length, head_dim)
    keys, values = torch.randn(1, kv_heads, seen, head_dim), torch.randn(1, kv_heads, seen, head_dim)
    mask = attention_module._mask(seen - length, length, 0, seen, None, query.device)  # a chunk at the end, causal
    assert mask is not None
    # The reference: every query head with its own copy of K and V, all scores at once.
    scores = query @ keys.repeat_interleave(3, dim=1).transpose(-2, -1) * 0.25
    scores = scores.masked_fill(~mask, float("-inf"))
    expected_lse = torch.logsumexp(scores, dim=-1)
    expected = torch.softmax(scores, dim=-1) @ values.repeat_interleave(3, dim=1)
    monkeypatch.setattr(attention_module, "_SCORES_BYTES", 2 * heads * seen * 4)  # two queries' scores at a time
    made = []
    monkeypatch.setattr(attention_module.torch, "logsumexp", lambda x, dim: made.append(x.shape) or x.logsumexp(dim))
    out, lse = attention_module._attend_exactly(query, keys, values, mask, 0.25)
    assert made == [(1, kv_heads, 6, seen)] * 3 + [(1, kv_heads, 3, seen)]  # slices of 2, 2, 2 and 1 queries
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)


@pytest.mark.parametrize("shared", [False, True])
def test_a_chunk_after_a_long_context_attends_to_it_grouped_as_one_call_would(
    shared: bool, attention_path: str
) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, context, length = 4, 2, 16, 3100, 5  # past _GROUPED_CONTEXT
    kv = torch.randn(1, 2, kv_heads, context + length, head_dim)  # kv: [layers, 2, kv_heads, positions, head_dim]
    prefix = torch.randn(1, 2, kv_heads, 64, head_dim)  # a shared prefix before the buffer's positions, or none
    assert context >= attention_module._GROUPED_CONTEXT
    offset = 64 if shared else 0
    query = torch.randn(1, heads, length, head_dim)
    new = kv[0, :, :, context:].unsqueeze(1)  # new: [2, 1, kv_heads, length, head_dim], written back as it is
    segment = attention_module.Segment(kv, offset + context, length, offset, (prefix,) if shared else ())
    batch = attention_module.PackedBatch.of((segment,))
    layer = torch.nn.Module()
    layer.layer_idx = 0
    with attention_module.packed_step(batch):
        out, _ = attention_module.packed_attention(layer, query, new[0], new[1], None, scaling=0.25)
    keys = torch.cat(([prefix[0, 0]] if shared else []) + [kv[0, 0]], dim=1).unsqueeze(0)
    values = torch.cat(([prefix[0, 1]] if shared else []) + [kv[0, 1]], dim=1).unsqueeze(0)
    mask = attention_module._mask(offset + context, length, 0, offset + context + length, None, query.device)
    expected, _ = attention_module._attend_exactly(query, keys, values, mask, 0.25)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("runs", [1, 3, attention_module._MOST_RUNS + 4])  # the last: copied together by torch
def test_a_prefix_lent_in_runs_is_attended_as_one(runs: int, attention_path: str) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, shared, own = 4, 2, 16, 60, 5
    prefix = torch.randn(1, 2, kv_heads, shared, head_dim)  # prefix: [layers, 2, kv_heads, positions, head_dim]
    pieces = tuple(prefix.tensor_split(runs, dim=3))
    buffers = [torch.randn(1, 2, kv_heads, own + 1, head_dim) for _ in range(2)]  # each reader's own positions
    segments = tuple(attention_module.Segment(kv, shared + own, 1, shared, pieces) for kv in buffers)
    batch = attention_module.PackedBatch.of(segments)
    assert len(batch.shared) == 1 and len(batch.shared[0].kv) == runs  # one reader set: its runs go together
    query = torch.randn(1, heads, 2, head_dim)
    new = torch.stack([kv[0, :, :, own] for kv in buffers], dim=2).unsqueeze(1)  # [2, 1, kv_heads, 2, head_dim]
    layer = torch.nn.Module()
    layer.layer_idx = 0
    with attention_module.packed_step(batch):
        out, _ = attention_module.packed_attention(layer, query, new[0], new[1], None, scaling=0.25)
    for index, kv in enumerate(buffers):
        keys = torch.cat((prefix[0, 0], kv[0, 0]), dim=1).unsqueeze(0)  # keys: [1, kv_heads, positions, head_dim]
        values = torch.cat((prefix[0, 1], kv[0, 1]), dim=1).unsqueeze(0)
        expected, _ = attention_module._attend_exactly(query[:, :, index : index + 1], keys, values, None, 0.25)
        torch.testing.assert_close(out[:, index : index + 1], expected.transpose(1, 2), atol=1e-5, rtol=0)


async def test_requests_reading_one_shared_prefix_give_the_tokens_they_give_alone(
    make_backend: BackendFactory,
) -> None:
    backend = shared_backend(make_backend)
    prompts = [make_prompt(40, offset=0)[:32] + make_prompt(9 + i, offset=5 * i)[-(9 + i) :] for i in range(4)]
    alone = [(await collect(backend, prompt)).token_ids for prompt in prompts]
    blocks = await prefix_blocks(backend, prompts[0])
    together = await asyncio.gather(*(run_shared(backend, prompt, blocks[:4]) for prompt in prompts))
    assert together == alone
    stats = backend.admission()
    assert (stats.shared_prefixes, stats.shared_bytes, stats.bytes_in_use, stats.running) == (0, 0, 0, 0)


async def test_a_prefix_extending_a_shared_one_is_shared_too_and_holds_its_parent(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, expected = await a_prompt_and_its_blocks(make_backend, 60)
    root = await start_shared(backend, prompt, blocks[:2])
    # Past a shared prefix a new one ends where cached prompts fork (after block 5), not at the last cached block.
    deeper = await start_shared(backend, prompt, blocks[:7], forks=(1, 6))  # blocks 2..5 become a prefix, after 0..1
    assert (root.offset, deeper.offset, len(deeper.shared)) == (16, 48, 3)  # lent as runs of at most 3 blocks
    assert deeper.shared[0] is root.shared[0]
    beside = await start_shared(backend, prompt, blocks[:7])  # one block past `deeper` is too short for a prefix
    assert beside.offset == 48 and all(a is b for a, b in zip(beside.shared, deeper.shared, strict=True))
    beside.release()
    assert backend.admission().shared_prefixes == 2
    root.release()  # the deeper prefix still reads the root: it stays
    assert backend.admission().shared_prefixes == 2
    tokens = [chunk.token_id async for chunk in backend.generate(prompt, [], GREEDY, reservation=deeper)]
    assert tokens == expected
    assert backend.admission().shared_prefixes == 0 and backend.admission().bytes_in_use == 0
    whole = await start_shared(backend, prompt, blocks[:7])  # with no fork, a prefix takes every cached block
    assert (whole.offset, len(whole.shared)) == (56, 3)
    whole.release()


async def test_the_first_request_past_a_fork_fills_each_level_and_reads_all_of_them_in_place(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, expected = await a_prompt_and_its_blocks(make_backend, 60)
    first = backend.start_prefix(IDS[:7], forks=(3,))  # other cached prompts depart after block 2
    assert first is not None
    assert [(level.first_block, level.blocks) for level in first.fills] == [(0, 3), (3, 7)]
    while (fill := first.fill) is not None:
        first.filled(
            [torch.cat(blocks[fill.first_block : fill.blocks], dim=3)],
            ["host"] * (fill.blocks - fill.first_block),
            lambda: None,
        )
    reading = await backend.reserve(len(prompt), GREEDY.max_tokens, start=first)
    assert await reading.settle() == 56  # every cached block read in place, none copied into its own buffer
    departing = await start_shared(backend, prompt, blocks[:3])  # a prompt that departs at the fork reads level one
    assert departing.offset == 24 and departing.shared[0] is reading.shared[0]
    departing.release()
    tokens = [chunk.token_id async for chunk in backend.generate(prompt, [], GREEDY, reservation=reading)]
    assert tokens == expected
    assert backend.admission().shared_prefixes == 0


async def test_a_level_that_cannot_be_lent_fails_the_levels_after_it_and_the_request_reads_the_one_before(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, expected = await a_prompt_and_its_blocks(make_backend, 60)
    start = backend.start_prefix(IDS[:7], forks=(2, 4))
    assert start is not None and len(start.fills) == 3
    loans: list[int] = []
    assert start.filled([torch.cat(blocks[:2], dim=3)], ["host"] * 2, lambda: loans.append(0))
    assert not start.filled([blocks[2]], ["host"], lambda: loans.append(1))  # the level's second block: not lent
    assert start.fill is None and loans == [1]  # the third level failed with it, lending nothing
    waiter = backend.start_prefix(IDS[:7], forks=(2, 4))  # a failed level is found by nobody new
    assert waiter is not None and [(level.first_block, level.blocks) for level in waiter.fills] == [(2, 4), (4, 7)]
    waiter.release()  # never filled: reported as lending nothing, as a borrow that raised
    while waiter.fill is not None:
        waiter.filled((), (), lambda: None)
    reservation = await backend.reserve(len(prompt), GREEDY.max_tokens, start=start)
    assert await reservation.settle() == 16  # the first level, read in place; blocks 2 to 6 its own
    reservation.load(blocks[2:7])
    stream = backend.generate(prompt, blocks[2:7], GREEDY, reservation=reservation)
    assert [chunk.token_id async for chunk in stream] == expected
    assert loans == [1, 0]  # the first level's loan ended with its reader
    stats = backend.admission()
    assert (stats.shared_prefixes, stats.bytes_in_use, stats.running) == (0, 0, 0)


async def test_admission_counts_readers_of_a_shared_prefix_for_their_own_tokens(make_backend: BackendFactory) -> None:
    backend = shared_backend(make_backend)
    prompt = make_prompt(300)
    blocks = await prefix_blocks(backend, prompt)
    readers = [await start_shared(backend, prompt, blocks[:32]) for _ in range(3)]  # a 256-token prefix
    stats = backend.admission()
    own = readers[0].nbytes
    assert all(reader.offset == 256 and reader.nbytes == own for reader in readers)
    assert own == backend._buffers.nbytes_for(300 + GREEDY.max_tokens - 256)  # type: ignore[union-attr]
    assert (stats.shared_prefixes, stats.bytes_in_use) == (1, 3 * own)  # the prefix is the store's memory
    assert stats.shared_bytes == sum(run.numel() for run in readers[0].shared) * 4  # one copy of it, float32
    for reader in readers:
        reader.release()
    assert backend.admission().bytes_in_use == 0


async def test_a_prefix_lives_while_a_reader_does_and_a_cancelled_reader_lets_it_go(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, expected = await a_prompt_and_its_blocks(make_backend, 40)
    leaving = backend.generate(prompt, [], GREEDY, reservation=await start_shared(backend, prompt, blocks[:4]))
    staying = backend.generate(prompt, [], GREEDY, reservation=await start_shared(backend, prompt, blocks[:4]))
    first: TokenChunk = await anext(leaving)
    await leaving.aclose()  # a client that left: the model drops it before its next step
    assert backend.admission().shared_prefixes == 1
    tokens = [chunk.token_id async for chunk in staying]
    assert [first.token_id] == expected[:1] and tokens == expected
    stats = backend.admission()
    assert (stats.shared_prefixes, stats.bytes_in_use, stats.running) == (0, 0, 0)


async def test_a_failed_fill_leaves_the_request_and_those_waiting_for_it_on_their_own_buffers(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, expected = await a_prompt_and_its_blocks(make_backend, 40)
    filler = backend.start_prefix(IDS[:4])
    assert filler is not None and filler.fill is not None
    waiter = backend.start_prefix(IDS[:4])
    assert waiter is not None and waiter.fill is None  # it waits for the fill under way
    reservations = [await backend.reserve(len(prompt), GREEDY.max_tokens, start=s) for s in (filler, waiter)]
    settling = [asyncio.create_task(reservation.settle()) for reservation in reservations]
    loans = []
    lent = torch.cat(blocks[:3], dim=3)
    filler.filled([lent], ["host"] * 3, lambda: loans.append("given back"))  # the fourth block could not be lent
    assert [await task for task in settling] == [0, 0]
    assert loans == ["given back"]  # at once: nobody reads what was lent
    for reservation in reservations:
        # Each fetches its prefix into its own buffer, as before sharing (counted for all of it: none is left over).
        assert reservation.offset == 0 and reservation.buffer is not None
        reservation.load(blocks[:4])
        stream = backend.generate(prompt, blocks[:4], GREEDY, reservation=reservation)
        assert [chunk.token_id async for chunk in stream] == expected
    stats = backend.admission()
    assert (stats.shared_prefixes, stats.bytes_in_use, stats.running) == (0, 0, 0)


async def test_the_loan_ends_when_the_last_reader_of_a_prefix_and_of_those_extending_it_ends(
    make_backend: BackendFactory,
) -> None:
    backend, prompt, blocks, _ = await a_prompt_and_its_blocks(make_backend, 60)
    loans: list[str] = []
    root_start = backend.start_prefix(IDS[:2])
    assert root_start is not None and root_start.fill is not None
    root_start.filled([torch.cat(blocks[:2], dim=3)], ["host"] * 2, lambda: loans.append("root"))
    root = await backend.reserve(len(prompt), GREEDY.max_tokens, start=root_start)
    deeper_start = backend.start_prefix(IDS[:6])
    assert deeper_start is not None and deeper_start.fill is not None
    deeper_start.filled([torch.cat(blocks[2:6], dim=3)], ["host"] * 4, lambda: loans.append("deeper"))
    deeper = await backend.reserve(len(prompt), GREEDY.max_tokens, start=deeper_start)
    assert [await root.settle(), await deeper.settle()] == [16, 48]
    root.release()
    assert loans == []  # the deeper prefix reads the root
    deeper.release()
    assert loans == ["deeper", "root"]
    assert backend.admission().shared_prefixes == 0 and backend.admission().shared_bytes == 0


async def test_a_request_failing_mid_step_drops_its_reference(make_backend: BackendFactory) -> None:
    backend = shared_backend(make_backend)
    prompt = make_prompt(40)
    blocks = await prefix_blocks(backend, prompt)

    def broken(index: int, tokens: Sequence[int], kv: torch.Tensor) -> None:
        raise OSError("the store is gone")

    reservation = await start_shared(backend, prompt, blocks[:4])
    params = SamplingParams(max_tokens=30, temperature=0.0)
    stream = backend.generate(prompt, [], params, broken, reservation=reservation)
    with pytest.raises(OSError, match="the store is gone"):
        async for _ in stream:
            pass
    stats = backend.admission()
    assert (stats.shared_prefixes, stats.bytes_in_use, stats.running) == (0, 0, 0)


def test_models_with_windows_or_soft_capping_copy_the_prefix_and_say_why(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    backend = make_backend(make_mistral(tokenizer, sliding_window=12), min_shared_tokens=16)
    assert backend.prefix_reuse and backend.sharing_refusal is not None
    assert "sliding_attention" in backend.sharing_refusal
    assert shared_backend(make_backend).sharing_refusal is None


def test_a_windowed_model_starts_from_its_own_copy(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    backend = make_backend(make_mistral(tokenizer, sliding_window=12), min_shared_tokens=16)
    assert backend.start_prefix(IDS[:4]) is None
