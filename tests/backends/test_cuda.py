"""On a GPU: packed steps batch requests on CUDA (eager and compiled), start them from cached blocks and from one
shared prefix, attention returns its log-sum-exp from one fused kernel, and the engine serves from a device tier,
lending a shared prefix in place from it. Skipped without CUDA;
`benchmarks/gpu_check.sh` runs them (and the store's) where there is one."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import SamplingParams, StepRecord
from prefixgate.backends import attention as attention_module
from prefixgate.backends.sampler import Sampler
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.settings import load_settings
from prefixgate.store import BlockLayout, StoreConfig, TierConfig, TieredStore
from tests.backends.conftest import BackendFactory
from tests.backends.streams import BlockSink, collect
from tests.backends.test_batching import LONGER, PROMPTS, alone
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.test_shared_prefix import run_shared

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU = torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_llama(llama: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Return a float32 copy of the tiny Llama on the GPU (float32, so batched and lone runs agree to the token)."""
    model = copy.deepcopy(llama).to(GPU)  # type: ignore[arg-type]
    yield model
    del model
    torch.cuda.empty_cache()


async def test_requests_batched_on_the_gpu_get_the_tokens_each_gets_alone(
    make_backend: BackendFactory, gpu_llama: PreTrainedModel
) -> None:
    steps: list[StepRecord] = []
    backend = make_backend(gpu_llama, on_step=steps.append)
    assert backend.device.type == "cuda" and backend.prefix_reuse, backend.reuse_refusal
    expected = await alone(backend, PROMPTS, [LONGER] * len(PROMPTS))
    steps.clear()
    together = await asyncio.gather(*(collect(backend, prompt, params=LONGER) for prompt in PROMPTS))
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]
    assert max(len(step.seq_ids()) for step in steps) == len(PROMPTS), "the requests shared forward passes"


async def test_compiled_steps_on_the_gpu_give_the_tokens_of_eager_ones(
    make_backend: BackendFactory, gpu_llama: PreTrainedModel
) -> None:
    expected = await alone(make_backend(gpu_llama), PROMPTS, [LONGER] * len(PROMPTS))
    backend = make_backend(copy.deepcopy(gpu_llama), compile_steps=True)
    assert backend.compiling is not None
    await asyncio.to_thread(backend.compiling.join)
    assert backend.steps == "compiled"
    together = await asyncio.gather(*(collect(backend, prompt, params=LONGER) for prompt in PROMPTS))
    assert [g.token_ids for g in together] == [g.token_ids for g in expected]


async def test_a_request_on_the_gpu_starts_from_its_cached_blocks(
    make_backend: BackendFactory, gpu_llama: PreTrainedModel
) -> None:
    steps: list[StepRecord] = []
    backend = make_backend(gpu_llama, on_step=steps.append)
    prompt = PROMPTS[3]
    sink = BlockSink()
    cold = await collect(backend, prompt, on_block=sink)
    assert sink.blocks and all(block.device.type == "cuda" for block in sink.blocks)
    steps.clear()
    warm = await collect(backend, prompt, blocks=sink.blocks[: (len(prompt) - 1) // 8])
    assert warm.token_ids == cold.token_ids
    assert sum(step.tokens("prefill") for step in steps) < len(prompt), "the cached blocks were not computed again"


async def test_requests_on_the_gpu_read_one_shared_prefix_and_get_the_tokens_each_gets_alone(
    make_backend: BackendFactory, gpu_llama: PreTrainedModel
) -> None:
    backend = make_backend(gpu_llama, min_shared_tokens=16)
    assert backend.sharing_refusal is None
    prompts = [make_prompt(40)[:32] + make_prompt(9 + i, offset=5 * i)[-(9 + i) :] for i in range(4)]
    expected = [(await collect(backend, prompt)).token_ids for prompt in prompts]
    sink = BlockSink()
    await collect(backend, prompts[0], on_block=sink)
    together = await asyncio.gather(*(run_shared(backend, prompt, sink.blocks[:4]) for prompt in prompts))
    assert together == expected
    assert backend.admission().shared_prefixes == 0 and backend.admission().bytes_in_use == 0


@pytest.fixture
async def gpu_engine(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, gpu_llama: PreTrainedModel, make_backend: BackendFactory
) -> AsyncIterator[Engine]:
    """An engine on the GPU model over a store with a device tier on the GPU, a pinned host tier and a disk tier."""
    backend = make_backend(gpu_llama)
    geometry = backend.geometry
    layout = BlockLayout(geometry.block_shape, geometry.dtype)
    config = StoreConfig(TierConfig(64 * layout.nbytes), TierConfig(64 * layout.nbytes), TierConfig(256 << 20))
    store = TieredStore.open(tmp_path / "store", layout, config, device=GPU)
    engine = Engine(backend, store, layout=load_settings().layout)
    yield engine
    await engine.close()


async def test_the_engine_serves_a_repeated_prompt_from_the_device_tier_on_the_gpu(gpu_engine: Engine) -> None:
    messages = [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": "Hi there"}]
    request = PromptRequest(params=SamplingParams(max_tokens=6, temperature=0.0), messages=messages)
    first = await gpu_engine.complete(request)
    second = await gpu_engine.complete(request)
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens > 0
    assert second.usage.cached_tokens_by_tier.get("device", 0) == second.usage.cached_tokens
    assert second.text == first.text


async def test_the_engine_on_the_gpu_lends_one_shared_prefix_in_place_from_the_device_tier(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, gpu_llama: PreTrainedModel, make_backend: BackendFactory
) -> None:
    lent: list[int] = []  # the device tier's lent slots after each step
    backend = make_backend(gpu_llama, min_shared_tokens=16, on_step=lambda _: lent.append(store.tiers[0].lent()))
    geometry = backend.geometry
    layout = BlockLayout(geometry.block_shape, geometry.dtype)
    config = StoreConfig(TierConfig(64 * layout.nbytes), TierConfig(64 * layout.nbytes), TierConfig(0))
    store = TieredStore.open(None, layout, config, device=GPU)
    engine = Engine(backend, store, layout=load_settings().layout)
    system = {"role": "system", "content": "You are terse and answer in one word. " * 4}
    requests = [
        PromptRequest(
            params=SamplingParams(max_tokens=6, temperature=0.0),
            messages=[system, {"role": "user", "content": f"Question {index}: what is the capital of France?"}],
        )
        for index in range(3)
    ]
    try:
        assert store.lends and store.tiers[0].name == "device"
        alone = [await engine.complete(request) for request in requests]  # each caches its prompt
        lent.clear()
        together = await asyncio.gather(*(engine.complete(request) for request in requests))
        assert [answer.text for answer in together] == [answer.text for answer in alone]
        assert all(answer.usage.cached_tokens_by_tier.get("device", 0) > 0 for answer in together)
        assert max(lent) > 0 and store.tiers[0].lent() == 0  # read in place while they ran, given back at the end
    finally:
        await engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "seen"), [(1, 70), (1, 4096), (7, 70), (33, 300)])
def test_attention_with_its_log_sum_exp_on_the_gpu_gives_what_plain_products_give(
    dtype: torch.dtype, length: int, seen: int
) -> None:
    # SmolLM2's heads (9 query heads read 3 KV heads of 64): one decoding token or a prompt chunk at the end of its
    # keys, causal (the mask of a chunk), against the same attention in plain float32 matrix products.
    torch.manual_seed(0)
    query = torch.randn(1, 9, length, 64, device=GPU).to(dtype)
    kv = torch.randn(2, 3, seen, 64, device=GPU).to(dtype)
    keys, values = kv[0:1], kv[1:2]
    mask = attention_module._mask(seen - length, length, 0, seen, None, GPU)
    assert (mask is None) == (length == 1)
    out, lse = attention_module.attend_with_lse(query, keys, values, mask, 0.125)
    expected, expected_lse = attention_module._attend_exactly(query.float(), keys.float(), values.float(), mask, 0.125)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (1, 9, length)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=tolerance, rtol=0)


def test_a_masked_chunk_on_the_gpu_makes_its_scores_to_add_a_slice_of_queries_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    length, seen = 7, 300  # a chunk of 7 queries at the end of 300 keys, causal
    query = torch.randn(1, 9, length, 64, device=GPU)
    kv = torch.randn(2, 3, seen, 64, device=GPU)
    mask = attention_module._mask(seen - length, length, 0, seen, None, GPU)
    # Room for the scores to add of 2 queries at a time (3 query heads a KV head, rows of 304 float32 values).
    monkeypatch.setattr(attention_module, "_SCORES_BYTES", 2 * 3 * 304 * 4)
    calls = []
    kernel = attention_module._EFFICIENT
    monkeypatch.setattr(attention_module, "_EFFICIENT", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    out, lse = attention_module.attend_with_lse(query, kv[0:1], kv[1:2], mask, 0.125)
    assert calls == [(1, 3, 6, 64)] * 3 + [(1, 3, 3, 64)]  # slices of 2, 2, 2 and 1 queries, 3 rows each
    expected, expected_lse = attention_module._attend_exactly(query, kv[0:1], kv[1:2], mask, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)


def test_the_sampler_picks_on_the_gpu_from_the_candidates_it_keeps() -> None:
    # Seeded picks among logits on the device, narrowed by top-k and top-p, as on a CPU (see test_sampler.py).
    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -1.0, 1.0], device=GPU)
    for params, kept in (
        (SamplingParams(temperature=1.0, seed=0), set(range(6))),
        (SamplingParams(temperature=2.0, top_k=2, seed=0), {1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.6, seed=0), {1, 2}),
    ):
        sampler = Sampler(params, GPU)
        picks = {sampler.pick(logits) for _ in range(300)}
        assert picks <= kept and len(picks) > 1
    assert Sampler(SamplingParams(temperature=0.0), GPU).pick(logits) == 1
