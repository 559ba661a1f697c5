"""Starting from cached KV blocks gives what a full recompute gives: logits, tokens and the blocks handed back."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from prefixgate.backends import SamplingParams, StepRecord
from prefixgate.backends.model_runner import ModelRunner, StepInput
from tests.backends.conftest import BackendFactory
from tests.backends.streams import GREEDY, BlockSink, collect, transformers_attention, transformers_greedy

# float32 on CPU: a cached prefix and a full recompute differ only by summation order, far below this.
ATOL = 1e-4


def make_prompt(length: int, offset: int = 3) -> list[int]:
    """Return a deterministic prompt of `length` ordinary token ids."""
    return [(offset + 7 * i) % 250 + 3 for i in range(length)]


def reference_cache(model: PreTrainedModel, token_ids: list[int]) -> DynamicCache:
    """Run transformers itself over all tokens in one pass and return its cache."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), transformers_attention(model):
        model(torch.tensor([token_ids]), use_cache=True, **{ModelRunner(model).cache_argument: cache})
    return cache


def reference_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Return every position's logits from transformers itself, all tokens in one pass."""
    with torch.inference_mode(), transformers_attention(model):
        return model(torch.tensor([token_ids])).logits[0].float()  # logits: [tokens, vocab]


def reference_block(cache: DynamicCache, index: int, size: int) -> torch.Tensor:
    """Slice block `index` out of a reference cache."""
    span = slice(index * size, (index + 1) * size)
    layers = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
        layers.append(torch.stack((layer.keys[0, :, span], layer.values[0, :, span])))  # [2, kv_heads, bs, head_dim]
    return torch.stack(layers)  # block: [layers, 2, kv_heads, block, head_dim]


async def prefilled_blocks(make_backend: BackendFactory, length: int) -> tuple[list[int], list[torch.Tensor]]:
    """Return a prompt of `length` tokens and its full blocks, as a backend computes them."""
    prompt = make_prompt(length)
    sink = BlockSink()
    assert await make_backend().prefill(prompt, [], sink) == length // 8 * 8
    return prompt, sink.blocks


def buffer_from(blocks: list[torch.Tensor], capacity: int) -> torch.Tensor:
    """Return a KV buffer of `capacity` tokens whose leading positions hold `blocks`."""
    buffer = torch.zeros((*blocks[0].shape[:3], capacity, blocks[0].shape[4]))
    buffer[:, :, :, : len(blocks) * 8] = torch.cat(blocks, dim=3)
    return buffer  # buffer: [layers, 2, kv_heads, capacity, head_dim]


async def test_logits_after_cached_prefix_match_full_recompute(
    make_backend: BackendFactory, llama: PreTrainedModel
) -> None:
    prompt, blocks = await prefilled_blocks(make_backend, 45)
    runner = ModelRunner(llama)
    runner.pack()
    with torch.inference_mode():
        full = reference_logits(llama, prompt)  # full: [45, vocab]
        for cached in (1, 3, 5):
            buffer = buffer_from(blocks[:cached], 64)
            # The suffix one token at a time after the prefix, and in one chunk: each position's logits as in full.
            for position in range(cached * 8, 45):
                logits = runner.run([StepInput(prompt[position : position + 1], buffer, position)])
                torch.testing.assert_close(logits[0], full[position], atol=ATOL, rtol=0)
            logits = runner.run([StepInput(prompt[cached * 8 :], buffer_from(blocks[:cached], 64), cached * 8)])
            torch.testing.assert_close(logits[0], full[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("shared", [0, 1, 4, 7])  # 8-token blocks: none, one, a middle count, all but one
async def test_a_partial_block_serves_exactly_its_shared_positions_as_a_full_recompute_would(
    make_backend: BackendFactory, llama: PreTrainedModel, steps: list[StepRecord], shared: int
) -> None:
    backend = make_backend(on_step=steps.append)
    first = make_prompt(40)
    second = first[: 16 + shared] + make_prompt(20, offset=11)  # departs from the first in block 2
    assert second[16 + shared] != first[16 + shared]
    sink = BlockSink()
    await backend.prefill(first, [], sink)
    # Block 2 of the first prompt holds the second's positions 16 .. 16 + shared: the leading ones, and no more.
    cached = sink.blocks[:2] + ([sink.blocks[2][:, :, :, :shared]] if shared else [])
    steps.clear()
    again = BlockSink()
    reused = await collect(backend, second, cached, on_block=again)
    assert sum(step.tokens("prefill") for step in steps) == len(second) - 16 - shared
    assert reused.token_ids == (await collect(backend, second)).token_ids
    assert again.indices[0] == 2 and again.tokens[0] == second[16:24]  # the completed block is handed back
    runner = ModelRunner(llama)
    runner.pack()
    with torch.inference_mode():
        buffer = torch.zeros((*sink.blocks[0].shape[:3], 64, sink.blocks[0].shape[4]))
        buffer[:, :, :, : 16 + shared] = torch.cat(cached, dim=3)  # buffer: [layers, 2, kv_heads, 64, head_dim]
        logits = runner.run([StepInput(second[16 + shared :], buffer, 16 + shared)])
        torch.testing.assert_close(logits[0], reference_logits(llama, second)[-1], atol=ATOL, rtol=0)


async def test_a_packed_step_gives_each_request_the_logits_it_would_get_alone(
    make_backend: BackendFactory, llama: PreTrainedModel
) -> None:
    prompt, blocks = await prefilled_blocks(make_backend, 45)
    other = make_prompt(30, offset=11)
    runner = ModelRunner(llama)
    runner.pack()
    with torch.inference_mode():
        full, other_full = reference_logits(llama, prompt), reference_logits(llama, other)
        cached, decoding = buffer_from(blocks[:2], 64), buffer_from(blocks[:5], 64)
        fresh = torch.zeros_like(cached)
        # One step: a chunk after a cached prefix, a fresh prompt's first chunk, and a single token of a third.
        logits = runner.run(
            [
                StepInput(prompt[16:30], cached, 16),
                StepInput(other[:20], fresh, 0),
                StepInput(prompt[40:41], decoding, 40),
            ]
        )
        torch.testing.assert_close(logits[0], full[29], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], other_full[19], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[2], full[40], atol=ATOL, rtol=0)
        # The next step continues each one from what the first step wrote into its buffer.
        logits = runner.run([StepInput(other[20:], fresh, 20), StepInput(prompt[30:45], cached, 30)])
        torch.testing.assert_close(logits[0], other_full[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1], full[-1], atol=ATOL, rtol=0)
        # An input that asks for every position's logits (a prompt's log probabilities) gets a row for each, in order,
        # before the next input's row.
        logits = runner.run(
            [
                StepInput(other[:20], torch.zeros_like(fresh), 0, every_logit=True),
                StepInput(prompt[41:42], decoding, 41),
            ]
        )
        assert logits.shape[0] == 21
        torch.testing.assert_close(logits[:20], other_full[:20], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[20], full[41], atol=ATOL, rtol=0)


async def test_greedy_continuation_is_token_identical_with_and_without_cached_blocks(
    make_backend: BackendFactory,
) -> None:
    backend = make_backend()
    prompt = make_prompt(37)
    sink = BlockSink()
    full = await collect(backend, prompt, on_block=sink)
    assert sink.indices[:4] == [0, 1, 2, 3]
    for cached in (1, 2, 4):
        reused = await collect(backend, prompt, sink.blocks[:cached])
        assert reused.token_ids == full.token_ids
        assert reused.text == full.text


async def test_greedy_output_matches_transformers_generate(
    make_backend: BackendFactory, llama: PreTrainedModel
) -> None:
    prompt = make_prompt(37)
    expected = transformers_greedy(llama, prompt, GREEDY.max_tokens)
    backend = make_backend(prefill_chunk_tokens=5)
    sink = BlockSink()
    assert (await collect(backend, prompt, on_block=sink)).token_ids == expected
    assert (await collect(backend, prompt, sink.blocks[:3])).token_ids == expected


async def test_chunked_prefill_equals_unchunked(make_backend: BackendFactory) -> None:
    prompt = make_prompt(61)
    one_pass, chunked = BlockSink(), BlockSink()
    whole = await collect(make_backend(prefill_chunk_tokens=1000), prompt, on_block=one_pass)
    # 5-token chunks straddle block boundaries, so blocks complete mid-chunk and across chunks.
    pieces = await collect(make_backend(prefill_chunk_tokens=5), prompt, on_block=chunked)
    assert pieces.token_ids == whole.token_ids
    assert chunked.indices == one_pass.indices
    for a, b in zip(chunked.blocks, one_pass.blocks, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


async def test_each_prefill_chunk_hands_back_its_completed_blocks_at_once(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    events: list[str] = []
    backend = make_backend(prefill_chunk_tokens=20, on_step=lambda r: events.append(f"prefill:{r.tokens('prefill')}"))
    await backend.prefill(make_prompt(64), [], lambda i, _t, _kv: events.append(f"block:{i}"))
    # Chunks end at tokens 20, 40, 60, 64: blocks 0-1, 2-4, 5-6, 7 complete in those chunks.
    assert events == [
        "block:0", "block:1", "prefill:20",
        "block:2", "block:3", "block:4", "prefill:20",
        "block:5", "block:6", "prefill:20",
        "block:7", "prefill:4",
    ]  # fmt: skip


async def test_full_prompt_hit_still_computes_the_last_token(
    make_backend: BackendFactory, steps: list[StepRecord]
) -> None:
    backend = make_backend(on_step=steps.append)
    prompt = make_prompt(32)  # exactly 4 blocks
    sink = BlockSink()
    full = await collect(backend, prompt, on_block=sink)
    steps.clear()
    again = BlockSink()
    hit = await collect(backend, prompt, sink.blocks[:4], on_block=again)
    prefill = [s.tokens("prefill") for s in steps if s.tokens("prefill")]
    # All 4 blocks were offered; the last is cut short by one token, recomputed to get the last token's logits.
    assert prefill == [1]
    assert hit.token_ids == full.token_ids
    assert 3 not in again.indices, "a block the caller passed in is never handed back"


async def test_blocks_handed_back_equal_slices_of_a_full_recompute_cache(
    make_backend: BackendFactory, llama: PreTrainedModel
) -> None:
    backend = make_backend()
    prompt = make_prompt(27)
    sink = BlockSink()
    result = await collect(backend, prompt, params=SamplingParams(max_tokens=30, temperature=0), on_block=sink)
    assert result.finish_reason == "length"
    every = prompt + result.token_ids
    # The last generated token is never fed back, so blocks cover at most all but it.
    assert sink.indices == list(range((len(every) - 1) // 8))
    assert len(sink.indices) > len(prompt) // 8, "decode must hand back blocks of generated tokens too"
    cache = reference_cache(llama, every[:-1])
    for index, tokens, kv in zip(sink.indices, sink.tokens, sink.blocks, strict=True):
        assert tokens == every[index * 8 : (index + 1) * 8]
        assert kv.shape == backend.geometry.block_shape and kv.dtype == backend.geometry.dtype
        assert kv._base is None and kv.is_contiguous(), "a block is a standalone tensor, not a view of the cache"
        assert not kv.is_inference(), "a store may write to the block in place"
        torch.testing.assert_close(kv, reference_block(cache, index, 8), atol=ATOL, rtol=0)
    assert all(name.startswith("prefixgate-") for name in sink.threads)


async def test_prefill_hands_back_only_new_full_blocks(make_backend: BackendFactory) -> None:
    backend = make_backend()
    prompt = make_prompt(29)
    first = BlockSink()
    assert await backend.prefill(prompt, [], first) == 24
    assert first.indices == [0, 1, 2]
    second = BlockSink()
    assert await backend.prefill(prompt, first.blocks[:1], second) == 16
    assert second.indices == [1, 2]
    torch.testing.assert_close(second.blocks[1], first.blocks[2], atol=ATOL, rtol=0)
    nothing = BlockSink()
    assert await backend.prefill(prompt, first.blocks, nothing) == 0
    assert nothing.indices == []


async def test_blocks_load_onto_the_model_from_any_layout_of_the_same_geometry(make_backend: BackendFactory) -> None:
    backend = make_backend()
    prompt = make_prompt(20)
    sink = BlockSink()
    full = await collect(backend, prompt, on_block=sink)
    # A store may hand back non-contiguous tensors (e.g. slices of a pool); values, not layout, matter.
    strided = [b.transpose(3, 4).contiguous().transpose(3, 4) for b in sink.blocks]
    assert not strided[0].is_contiguous()
    assert (await collect(backend, prompt, strided[:2])).token_ids == full.token_ids


@pytest.mark.parametrize("chunk", [5, 1000])
async def test_a_prompts_log_probabilities_are_those_of_a_full_forward_pass(
    make_backend: BackendFactory, llama: PreTrainedModel, chunk: int
) -> None:
    prompt = make_prompt(37)
    backend = make_backend(prefill_chunk_tokens=chunk)  # 5: chunks that straddle blocks, each scored as it runs
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    chunks = [c async for c in backend.generate(prompt, [], params)]
    scored = chunks[0].prompt_logprobs
    assert len(scored) == len(prompt) and scored[0].logprob is None  # the first token has nothing before it
    assert all(c.prompt_logprobs == () for c in chunks[1:])
    expected = torch.log_softmax(reference_logits(llama, prompt), dim=-1)  # expected: [tokens, vocab]
    for position, entry in enumerate(scored[1:], start=1):
        assert entry.logprob == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)
        row = expected[position - 1]
        assert (entry.token_id, entry.rank) == (prompt[position], int((row > row[prompt[position]]).sum()) + 1)
        best = torch.topk(expected[position - 1], 2)
        assert [top.logprob for top in entry.top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert [top.token for top in entry.top] == [backend._token_text(int(t)) for t in best.indices]
    # the answer is the one asked without them
    assert [c.token_id for c in chunks] == (
        await collect(backend, prompt, params=replace(params, prompt_logprobs=None))
    ).token_ids


async def test_steps_that_score_a_prompt_are_left_out_of_the_schedulers_measures(make_backend: BackendFactory) -> None:
    backend = make_backend()
    costs = backend._worker._scheduler.costs
    await collect(backend, make_prompt(37), params=replace(GREEDY, max_tokens=1, prompt_logprobs=0))
    assert costs.seconds_per_unit is None  # its prompt's every position's logits: not what a prompt costs
    await collect(backend, make_prompt(37, offset=5), params=replace(GREEDY, max_tokens=1))
    assert costs.seconds_per_unit is not None


async def test_a_request_for_its_prompts_log_probabilities_takes_no_cached_prefix(make_backend: BackendFactory) -> None:
    prompt, blocks = await prefilled_blocks(make_backend, 45)
    with pytest.raises(RuntimeError, match="starts from no cached prefix"):
        make_backend().generate(prompt, blocks[:2], SamplingParams(max_tokens=2, prompt_logprobs=0))


async def test_a_prompt_scored_beside_a_decoding_stream_leaves_each_its_own_answer(
    make_backend: BackendFactory, llama: PreTrainedModel, steps: list[StepRecord]
) -> None:
    prompt, other = make_prompt(37), make_prompt(20, offset=11)
    alone = make_backend()
    expected = [(await collect(alone, p, params=replace(GREEDY, max_tokens=12))).token_ids for p in (prompt, other)]
    backend = make_backend(prefill_chunk_tokens=5, on_step=steps.append)
    decoding = backend.generate(other, [], replace(GREEDY, max_tokens=12))
    first = await anext(decoding)  # the other stream decodes from here on, through the scored prompt's chunks
    scored = [c async for c in backend.generate(prompt, [], replace(GREEDY, max_tokens=12, prompt_logprobs=0))]
    rest = [c async for c in decoding]
    assert [first.token_id, *(c.token_id for c in rest)] == expected[1]
    assert [c.token_id for c in scored] == expected[0]
    assert any({w.kind for w in step.work} == {"prefill", "decode"} for step in steps)  # they shared steps
    log_softmax = torch.log_softmax(reference_logits(llama, prompt), dim=-1)
    got = [entry.logprob for entry in scored[0].prompt_logprobs[1:]]
    want = [float(log_softmax[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    assert got == pytest.approx(want, abs=1e-4)
