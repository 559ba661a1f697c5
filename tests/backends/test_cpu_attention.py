"""The C attention kernel (bfloat16 on AVX-512 BF16 or AMX, float32 on AVX2 or AVX-512): built by the machine's
compiler, exact to float32 scores, optional."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from prefixgate.backends import attention as attention_module
from prefixgate.backends import cpu_attention
from prefixgate.backends.model_runner import ModelRunner, StepInput
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.test_shared_prefix import prefix_blocks, run_shared, shared_backend
from tests.backends.tiny_models import make_llama

# The dtypes the kernel runs in on this machine: where it runs in none, the tests parametrized by them are skipped.
KERNEL_DTYPES = [dtype for dtype in (torch.bfloat16, torch.float32) if cpu_attention._library(dtype) is not None]
needs_bfloat16_kernel = pytest.mark.skipif(
    torch.bfloat16 not in KERNEL_DTYPES, reason="the bfloat16 kernel does not run here (see the log for why)"
)
DTYPE_NAME = cpu_attention._name
BUILDS = [(dtype, build) for dtype in KERNEL_DTYPES for build in cpu_attention._builds(dtype)]


def close(dtype: torch.dtype) -> dict[str, float]:
    """Return the tolerance of the kernel's outputs against float64 attention: bfloat16's rounding of the
    probabilities and the output, or float32's."""
    return {"atol": 2e-2, "rtol": 2**-7} if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 1e-5}


def reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> tuple[Any, Any]:
    """Attention in float64 of queries `[1, heads, count, d]` over keys and values `[kv_heads, tokens, d]` (query head
    j reading KV head j // groups): `[1, heads, count, d]` and its log-sum-exp, `[1, heads, count]`."""
    groups = queries.shape[1] // keys.shape[0]
    keys, values = keys.double().repeat_interleave(groups, 0), values.double().repeat_interleave(groups, 0)
    scores = queries.double() @ keys.transpose(-2, -1).unsqueeze(0) * scale
    return torch.softmax(scores, dim=-1) @ values.unsqueeze(0), torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "count", "tokens", "head_dim"),
    [
        (9, 3, 8, 4096, 64),  # SmolLM2, 8 decoding streams on a 4k-token prefix: 24 rows per KV head
        (9, 3, 5, 1000, 64),  # keys that end inside a run of 256, a pair and a tile
        (4, 2, 65, 300, 64),  # 130 rows per KV head: past a block of 64, and a last tile of 2 rows
        (9, 3, 16, 700, 64),  # 16 streams: 48 rows per KV head, two sets of 24 for each few keys
        (4, 1, 8, 515, 64),  # 32 rows per KV head: 8 of them beside 24, and 3 keys past a run of 4
        (1, 1, 1, 1, 64),  # one key
        (4, 2, 7, 77, 128),  # a wider head
        (4, 2, 7, 600, 128),  # a wider head over whole runs: 14 rows a KV head, two passes of the outputs' columns
        (6, 2, 9, 300, 128),  # 27 rows: two tiles of rows, four passes
        (8, 2, 10, 520, 128),  # 40 rows: three tiles of rows, eight passes
    ],
)
@pytest.mark.parametrize(("dtype", "build"), BUILDS, ids=[cpu_attention.build_name(build) for _, build in BUILDS])
def test_the_kernel_merges_attention_over_its_keys_into_what_the_caller_holds(
    heads: int,
    kv_heads: int,
    count: int,
    tokens: int,
    head_dim: int,
    dtype: torch.dtype,
    build: tuple[str, ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each build this CPU runs: AVX-512 BF16 products, and on a CPU with AMX, AMX tiles (the one used there); for
    # float32 AVX2, and on a CPU with AVX-512 its vectors (the one used there).
    library = cpu_attention._load(build)
    assert not isinstance(library, str), library
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: cpu_attention.Kernels(library, library))
    torch.manual_seed(0)
    scale = head_dim**-0.5
    queries = torch.randn(1, heads, count, head_dim).to(dtype)
    kv = (torch.randn(2, kv_heads, tokens + 40, head_dim) * 2).to(dtype)  # wide scores: softmax far from uniform
    prefix, own = kv[:, :, :tokens], kv[:, :, tokens:]  # the shared keys, and the request's own 40
    held, held_lse = reference(queries, own[0], own[1], scale)  # what the step holds before the kernel runs
    out, lse = held.to(dtype), held_lse.float()
    expected, expected_lse = reference(queries, kv[0], kv[1], scale)  # over both at once
    assert cpu_attention.applies(queries, prefix)
    cpu_attention.attend_into(queries, prefix, scale, out, lse)
    # Scores are exact products summed in float32; in bfloat16 the error is its rounding of the probabilities and
    # the output.
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), expected, **close(dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
@pytest.mark.parametrize(("history", "count"), [(0, 1), (0, 27), (38, 27), (700, 300), (5, 1), (491, 21), (250, 12)])
def test_new_tokens_see_the_keys_before_them_and_their_own_up_to_themselves(
    history: int, count: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    queries = torch.randn(1, 9, count, 64).to(dtype)
    kv = (torch.randn(2, 3, history + count, 64) * 2).to(dtype)
    # Nothing held: minus infinity, and an output never initialised, which must not be read.
    out, lse = torch.full((1, 9, count, 64), float("nan")).to(dtype), torch.full((1, 9, count), float("-inf"))
    cpu_attention.attend_into(queries, kv, 0.125, out, lse, causal_from=history)
    mask = attention_module._mask(history, count, 0, history + count, None, queries.device)
    expected, expected_lse = attention_module._attend_exactly(queries.float(), kv[0:1], kv[1:2], mask, 0.125)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.float(), expected, **close(dtype))


@pytest.mark.parametrize("count", [40, 8], ids=["80 rows a KV head", "16 rows a KV head"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_a_score_far_above_the_keys_before_it_is_attended_exactly(dtype: torch.dtype, count: int) -> None:
    # A row's softmax takes each chunk after its first against the max the row has seen, unless a score rises far past
    # it: for 80 rows a KV head (past a block of 64) and for 16 (a decode step's few, whose whole runs of 256 keys are
    # read in place on AMX). Row 0 of head 0 meets a key thousands of times its other scores' size (its exponential
    # against the old max would overflow), row 1 of head 1 one that rises past it by a few dozen (exponentials far
    # above 1), each in a chunk after the first of its run of keys.
    torch.manual_seed(0)
    queries = torch.randn(1, 2, count, 64).to(dtype)
    kv = torch.randn(2, 1, 2000, 64).to(dtype)
    for position in (300, 600, 1100, 1900):
        kv[0, 0, position] = queries[0, 0, 0] * 20
        kv[0, 0, position + 50] = queries[0, 1, 1] * 1.5
    out, lse = torch.empty(1, 2, count, 64).to(dtype), torch.full((1, 2, count), float("-inf"))
    cpu_attention.attend_into(queries, kv, 0.125, out, lse)
    expected, expected_lse = reference(queries, kv[0], kv[1], 0.125)
    # Log-sum-exps up to about 180, where float32's values are 1.5e-5 apart.
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out.double(), expected, **close(dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_one_call_writes_each_parts_new_keys_and_attends_it_to_its_own_keys_only(dtype: torch.dtype) -> None:
    # A step's requests as parts of one call: decode rows and prompt chunks, each over its own buffer (buffers of
    # different capacities, layer 1 of 2), short ones and one long enough to be split in 8 runs of keys (past 8 x 256
    # positions). The step's new keys and values come position-major, as the model's projections give them.
    torch.manual_seed(0)
    shapes = [(40, 1), (0, 27), (2300, 1), (3, 64), (700, 130), (1, 1)]  # (positions before, new tokens)
    total = sum(count for _, count in shapes)
    queries = torch.randn(1, 9, total, 64).to(dtype)
    new_keys, new_values = ((torch.randn(1, total, 3, 64) * 2).to(dtype).transpose(1, 2) for _ in range(2))
    out, lse = torch.full((1, 9, total, 64), float("nan")).to(dtype), torch.full((1, 9, total), float("-inf"))
    parts, first = [], 0
    for history, count in shapes:
        buffer = (torch.randn(2, 2, 3, history + count + 17, 64) * 2).to(dtype)  # room past the positions filled
        parts.append(cpu_attention.Part(first, count, buffer, history + count, history))
        first += count
    untouched = [part.kv.clone() for part in parts]
    cpu_attention.attend_parts(queries, cpu_attention.Plan(parts), 1, 0.125, out, lse, new=(new_keys, new_values))
    for part, before in zip(parts, untouched, strict=True):
        rows, end = slice(part.first, part.first + part.length), part.tokens
        expected_kv = before.clone()
        expected_kv[1, 0, :, part.causal_from : end] = new_keys[0, :, rows]
        expected_kv[1, 1, :, part.causal_from : end] = new_values[0, :, rows]
        assert torch.equal(part.kv, expected_kv)  # the new positions written, nothing else
        kv = part.kv[1, :, :, :end]
        mask = attention_module._mask(part.causal_from, part.length, 0, end, None, queries.device)
        expected, expected_lse = attention_module._attend_exactly(
            queries[:, :, rows].float(), kv[0:1], kv[1:2], mask, 0.125
        )
        torch.testing.assert_close(lse[:, :, rows], expected_lse, atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, :, rows].float(), expected, **close(dtype))


@pytest.mark.parametrize(("dtype", "build"), BUILDS, ids=[cpu_attention.build_name(build) for _, build in BUILDS])
def test_parts_that_read_the_same_rows_merge_in_one_call_as_in_calls_one_after_another(
    dtype: torch.dtype, build: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's own parts (their new keys written first), then runs of shared positions read by some of the same rows,
    # in one call: each part on rows an earlier part reads merges after it, to the bits of a call a part in order.
    # Stages here: the own parts; the first run (rows 2 to 12); the second (rows 0 to 9, over 3 runs of 256 keys);
    # and beside it, in the same stage, a run read by rows 10 to 12 only.
    library = cpu_attention._load(build)
    assert not isinstance(library, str), library
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: cpu_attention.Kernels(library, library))
    torch.manual_seed(0)
    queries = torch.randn(1, 6, 13, 64).to(dtype)
    new = tuple((torch.randn(1, 13, 2, 64) * 2).to(dtype).transpose(1, 2) for _ in range(2))
    own = [(torch.randn(1, 2, 2, 40, 64) * 2).to(dtype) for _ in range(3)]
    shared = [(torch.randn(1, 2, 2, tokens, 64) * 2).to(dtype) for tokens in (300, 700, 90)]
    parts = [
        *(
            cpu_attention.Part(first, count, kv, 30 + count, 30)
            for (first, count), kv in zip([(0, 2), (2, 1), (3, 10)], own, strict=True)
        ),
        cpu_attention.Part(2, 11, shared[0], 300),
        cpu_attention.Part(0, 10, shared[1], 700),
        cpu_attention.Part(10, 3, shared[2], 90),
    ]
    held, held_lse = torch.randn(1, 6, 13, 64).to(dtype), torch.full((1, 6, 13), float("-inf"))
    results = []
    for together in (True, False):
        out, lse = held.clone(), held_lse.clone()
        for kv in own:
            kv[..., 30:, :] = 0  # the new positions, as before any call wrote them
        calls = [parts] if together else [[part] for part in parts]
        for call in calls:
            writes = new if any(part.causal_from is not None for part in call) else None
            cpu_attention.attend_parts(queries, cpu_attention.Plan(call), 0, 0.125, out, lse, new=writes)
        results.append((out, lse, [kv.clone() for kv in own]))
    (out, lse, written), (expected, expected_lse, expected_written) = results
    assert torch.equal(lse, expected_lse) and torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(written, expected_written, strict=True))
    row = 9  # the third own part's seventh row: its first 37 positions, then the first two runs
    kv = torch.cat([written[2][0, :, :, :37], shared[0][0], shared[1][0]], dim=2)
    reference_out, reference_lse = reference(queries[:, :, row : row + 1], kv[0], kv[1], 0.125)
    torch.testing.assert_close(lse[:, :, row : row + 1].double(), reference_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, :, row : row + 1].double(), reference_out, **close(dtype))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_queries_and_outputs_are_read_and_written_where_their_strides_say(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 2048, 64).to(dtype)
    queries = torch.randn(1, 12, 9, 64).to(dtype).transpose(1, 2).contiguous().transpose(1, 2)[:, :, 1:8]
    out = torch.zeros(1, 7, 12, 64).to(dtype).transpose(1, 2)  # [1, heads, count, d] stored position-major
    lse = torch.full((1, 12, 20), float("-inf"))[:, :, ::3][:, :, :7]  # every third: nothing held there yet
    untouched = lse.clone()
    cpu_attention.attend_into(queries, kv, 0.125, out, lse)
    expected, expected_lse = reference(queries, kv[0], kv[1], 0.125)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), expected, **close(dtype))
    assert not torch.equal(lse, untouched)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
@pytest.mark.parametrize(("threads", "kv_heads"), [(1, 3), (2, 3), (3, 2), (5, 3)])
def test_each_heads_keys_are_split_into_runs_by_the_threads_and_merged_exactly(
    threads: int, kv_heads: int, dtype: torch.dtype
) -> None:
    # A call splits each KV head's keys into as few runs as give every thread the same number of them (1, 2, 3 and 5
    # runs here), attended apart and merged by their log-sum-exps: the same attention at any thread count.
    torch.manual_seed(0)
    queries = torch.randn(1, 3 * kv_heads, 4, 64).to(dtype)
    kv = (torch.randn(2, kv_heads, 3000, 64) * 2).to(dtype)  # 12 chunks of 256 keys a head
    out, lse = torch.zeros_like(queries), torch.full(queries.shape[:3], float("-inf"))
    expected, expected_lse = reference(queries, kv[0], kv[1], 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_attention.attend_into(queries, kv, 0.125, out, lse)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), expected, **close(dtype))


@pytest.mark.skipif(
    len(cpu_attention._builds(torch.float32)) < 2 or torch.float32 not in KERNEL_DTYPES,
    reason="the float32 kernel has no AVX-512 build on this CPU",
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "count", "tokens", "head_dim", "causal_from"),
    [
        (9, 3, 8, 4096, 64, None),  # 8 decoding streams on a 4k prefix
        (9, 3, 432, 1000, 64, None),  # 16 prompts of 27 tokens: past 3 vectors of rows, and a block of 64
        (4, 1, 8, 515, 64, None),  # keys that end inside a run of 8 and of 256
        (4, 2, 7, 77, 128, None),  # a wider head
        (9, 3, 300, 1000, 64, 700),  # a prompt's own keys, causally
        (2, 2, 33, 40, 48, 7),  # a head of 48: three vectors of 16, one and a half of AVX2's
    ],
)
def test_the_avx512_float32_build_gives_the_avx2_builds_bits(
    heads: int,
    kv_heads: int,
    count: int,
    tokens: int,
    head_dim: int,
    causal_from: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each output is the same sum of the same products in the same order in 8 lanes or 16: wider vectors change how
    # many are done at once, never a result.
    avx2, avx512 = (cpu_attention._load(build) for build in cpu_attention._builds(torch.float32))
    assert not isinstance(avx2, str) and not isinstance(avx512, str)
    torch.manual_seed(0)
    queries = torch.randn(1, heads, count, head_dim)
    kv = torch.randn(2, kv_heads, tokens, head_dim) * 2
    held, held_lse = torch.randn(1, heads, count, head_dim), torch.randn(1, heads, count)  # attention over others
    results = []
    for library in (avx2, avx512):
        kernels = cpu_attention.Kernels(library, library)
        monkeypatch.setattr(cpu_attention, "_library", lambda dtype, kernels=kernels: kernels)
        out, lse = held.clone(), held_lse.clone()
        cpu_attention.attend_into(queries, kv, head_dim**-0.5, out, lse, causal_from=causal_from)
        results.append((out, lse))
    (out_avx2, lse_avx2), (out_avx512, lse_avx512) = results
    assert torch.equal(out_avx512, out_avx2) and torch.equal(lse_avx512, lse_avx2)
    assert not torch.equal(out_avx2, held)  # it attended


@needs_bfloat16_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "count", "tokens", "causal_from", "head_dim"),
    [
        (9, 3, 8, 4096, None, 64),  # 8 decoding streams on a 4k prefix: 24 rows a KV head
        (9, 3, 27, 1000, None, 64),  # 81 rows a KV head
        (9, 3, 432, 1000, None, 64),  # 16 prompts of 27 tokens: more rows than a block
        (4, 1, 5, 515, None, 64),  # keys that end inside a run of 256
        (9, 3, 300, 1000, 700, 64),  # a prompt's own keys, causally
        (9, 3, 1, 700, None, 64),  # one decoding stream: 3 rows
        (5, 1, 1, 100, None, 64),  # 5 rows, over keys that end inside a run of 32
        (9, 3, 3, 300, None, 64),  # 9 rows
        (4, 2, 7, 300, None, 128),  # 14 rows, two passes of 64 columns
        (2, 1, 5, 200, 150, 256),  # the widest heads, causally
    ],
)
def test_the_bfloat16_build_on_fmas_gives_the_dot_products_bits(
    heads: int,
    kv_heads: int,
    count: int,
    tokens: int,
    causal_from: int | None,
    head_dim: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each pair's second product added and then its first, each in one rounding, as `vdpbf16ps` adds them: the same
    # sums on float32 FMAs (as Intel's CPUs without AMX run them) as on the dot products (as AMD's do).
    dot, fma = (cpu_attention._load(flags) for flags in (cpu_attention._FLAGS, cpu_attention._FLAGS + ("-DON_FMA",)))
    assert not isinstance(dot, str) and not isinstance(fma, str)
    torch.manual_seed(0)
    queries = torch.randn(1, heads, count, head_dim).bfloat16()
    kv = (torch.randn(2, kv_heads, tokens, head_dim) * 2).bfloat16()
    held, held_lse = torch.randn(1, heads, count, head_dim).bfloat16(), torch.randn(1, heads, count)
    results = []
    for library in (dot, fma):
        kernels = cpu_attention.Kernels(library, library)
        monkeypatch.setattr(cpu_attention, "_library", lambda dtype, kernels=kernels: kernels)
        out, lse = held.clone(), held_lse.clone()
        cpu_attention.attend_into(queries, kv, head_dim**-0.5, out, lse, causal_from=causal_from)
        results.append((out, lse))
    (out_dot, lse_dot), (out_fma, lse_fma) = results
    assert torch.equal(out_fma, out_dot) and torch.equal(lse_fma, lse_dot)
    assert not torch.equal(out_dot, held)  # it attended


def in_kernel_order(kv: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Return `kv` (`[layers, 2, kv_heads, positions, d]`) laid out as a store's top tier in the kernel's order holds
    it, a block of `block` positions at a time."""
    tiled = torch.empty_like(kv)
    for at in range(0, kv.shape[3], block):
        cpu_attention.KernelOrder().write(tiled[:, :, :, at : at + block], kv[:, :, :, at : at + block])
    return tiled


def tiles_spelled_in_torch(kv: torch.Tensor) -> torch.Tensor:
    """`KernelOrder`'s layout of `kv` (`[layers, 2, kv_heads, positions, d]`) spelled in torch: each 16 keys as 16
    column pairs of each 32 columns by the 16 keys, each 32 values as 16 columns of each 16 by the 32 values in
    pairs."""
    layers, _, heads, tokens, d = kv.shape
    tiled = torch.empty_like(kv)
    keys = tiled[:, 0].view(layers, heads, tokens // 16, d // 32, 16, 16, 2).permute(0, 1, 2, 5, 3, 4, 6)
    keys.copy_(kv[:, 0].reshape(layers, heads, tokens // 16, 16, d // 32, 16, 2))
    values = tiled[:, 1].view(layers, heads, tokens // 32, d // 16, 16, 16, 2).permute(0, 1, 2, 4, 6, 3, 5)
    values.copy_(kv[:, 1].reshape(layers, heads, tokens // 32, 16, 2, d // 16, 16))
    return tiled


@needs_bfloat16_kernel
@pytest.mark.parametrize(("tokens", "head_dim"), [(32, 64), (64, 64), (64, 128), (96, 256)])
def test_the_kernels_order_lays_a_block_out_as_packing_does_and_back(
    tokens: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    dot = cpu_attention._load(cpu_attention._FLAGS)
    assert not isinstance(dot, str)
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: cpu_attention.Kernels(dot, dot))
    monkeypatch.setattr(cpu_attention, "_lay_out_function", cpu_attention._lay_out_function.__wrapped__)
    torch.manual_seed(0)
    pool = torch.randn(3, 2, 2, 4 * tokens, head_dim).bfloat16()  # a tier's pool: a slot is a slice of its positions
    kv = torch.randn(3, 2, 2, tokens, head_dim).bfloat16()
    before = pool.clone()
    slot = pool[:, :, :, tokens : 2 * tokens]
    cpu_attention.KernelOrder().write(slot, kv)
    assert torch.equal(slot, tiles_spelled_in_torch(kv))
    assert torch.equal(pool[:, :, :, :tokens], before[:, :, :, :tokens])  # the other slots as they were
    assert torch.equal(pool[:, :, :, 2 * tokens :], before[:, :, :, 2 * tokens :])
    out = torch.empty_like(kv)
    assert cpu_attention.KernelOrder().read(slot, out) is out and torch.equal(out, kv)


@needs_bfloat16_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "count", "tokens", "head_dim"),
    [
        (9, 3, 8, 4096, 64),  # 8 decoding streams on a 4k prefix
        (9, 3, 1, 1088, 64),  # one stream, over keys that end inside a run of 256
        (9, 3, 27, 1024, 64),  # 81 rows a KV head: two blocks of rows
        (9, 3, 432, 512, 64),  # 16 prompts of 27 tokens
        (4, 2, 7, 320, 128),  # a wider head: two passes of 64 columns
        (2, 1, 5, 96, 256),  # the widest heads
    ],
)
def test_a_prefix_in_the_kernels_order_is_read_where_it_lies_to_the_bits_of_token_order(
    heads: int, kv_heads: int, count: int, tokens: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On the build that packs each run of keys for its dot products (AMD's CPUs run it), a part `tiled` is read as
    # packing would have laid it out; every sum the same.
    dot = cpu_attention._load(cpu_attention._FLAGS)
    assert not isinstance(dot, str) and dot.prefixgate_takes_tiles() == 1
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: cpu_attention.Kernels(dot, dot))
    torch.manual_seed(0)
    queries = torch.randn(1, heads, count, head_dim).bfloat16()
    kv = (torch.randn(1, 2, kv_heads, tokens, head_dim) * 2).bfloat16()
    tiled = in_kernel_order(kv, 32 if tokens % 64 else 64)
    assert not torch.equal(tiled, kv)
    held, held_lse = torch.randn(1, heads, count, head_dim).bfloat16(), torch.randn(1, heads, count)
    results = []
    for part in (cpu_attention.Part(0, count, kv, tokens), cpu_attention.Part(0, count, tiled, tokens, tiled=True)):
        out, lse = held.clone(), held_lse.clone()
        cpu_attention.attend_parts(queries, cpu_attention.Plan([part]), 0, head_dim**-0.5, out, lse)
        results.append((out, lse))
    (out, lse), (out_tiled, lse_tiled) = results
    assert torch.equal(out_tiled, out) and torch.equal(lse_tiled, lse)
    assert not torch.equal(out, held)  # it attended


@needs_bfloat16_kernel
def test_builds_that_read_keys_in_token_order_refuse_a_tiled_part_and_so_does_a_ragged_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dot, fma = (cpu_attention._load(flags) for flags in (cpu_attention._FLAGS, cpu_attention._FLAGS + ("-DON_FMA",)))
    assert not isinstance(dot, str) and not isinstance(fma, str) and fma.prefixgate_takes_tiles() == 0
    kv = torch.randn(1, 2, 1, 96, 64).bfloat16()
    queries, out, lse = torch.randn(1, 1, 3, 64).bfloat16(), torch.zeros(1, 1, 3, 64).bfloat16(), torch.zeros(1, 1, 3)
    for library, part in (
        (fma, cpu_attention.Part(0, 3, kv, 96, tiled=True)),
        (dot, cpu_attention.Part(0, 3, kv, 80, tiled=True)),  # not whole groups of 32 positions
    ):
        monkeypatch.setattr(
            cpu_attention, "_library", lambda dtype, library=library: cpu_attention.Kernels(library, library)
        )
        with pytest.raises(ValueError, match="does not take these sizes"):
            cpu_attention.attend_parts(queries, cpu_attention.Plan([part]), 0, 0.125, out, lse)


# A kernel that takes no sizes at all: where a call runs on it, the call says so.
REFUSING_KERNEL = """
#include <stdint.h>
int prefixgate_request_amx(void) { return 0; }
int prefixgate_attend_parts(const void *q, int64_t q_head, int64_t q_row, void *out, int64_t out_head, int64_t out_row,
                            float *lse, int64_t lse_head, int64_t lse_row, const void *new_k, int64_t new_k_head,
                            int64_t new_k_row, const void *new_v, int64_t new_v_head, int64_t new_v_row,
                            int64_t kv_heads, int64_t groups, int64_t d, float scale, int64_t layer, int64_t count,
                            const int64_t *plans) {
    return -1;
}
"""


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_calls_of_more_than_a_few_rows_a_kv_head_run_on_the_many_rows_build(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = cpu_attention._library(dtype)
    assert real is not None
    source = tmp_path / "refusing.c"
    source.write_text(REFUSING_KERNEL)
    with monkeypatch.context() as building:
        building.setattr(cpu_attention, "kernel_dir", lambda: tmp_path)
        building.setattr(cpu_attention, "_SOURCES", (source,))
        refusing = cpu_attention._load(("-shared", "-fPIC"))
    assert not isinstance(refusing, str), refusing
    torch.manual_seed(0)
    prefix = torch.randn(2, 2, 3, 300, 64).to(dtype)  # prefix: [layers, 2, kv_heads, positions, head_dim]
    own = torch.randn(2, 2, 2, 3, 64, 64).to(dtype)  # each request's own: [layers, 2, kv_heads, capacity, d]
    query = torch.randn(1, 9, 4, 64).to(dtype)  # 2 requests of 2 new tokens each: 6 rows a KV head, 12 reading both
    key, value = torch.randn(2, 1, 3, 4, 64).to(dtype)
    segments = tuple(attention_module.Segment(own[i], 300 + 20, 2, 300, (prefix,)) for i in range(2))
    for kernels, refused in (
        (cpu_attention.Kernels(real.few, refusing), "many"),
        (cpu_attention.Kernels(refusing, real.many), "few"),
    ):
        monkeypatch.setattr(cpu_attention, "_library", lambda dtype, kernels=kernels: kernels)
        for count in (2, 3):  # 6 query rows a KV head, then 9: through the Python call
            queries, out, lse = (
                torch.randn(1, 9, count, 64).to(dtype),
                torch.zeros(1, 9, count, 64).to(dtype),
                torch.full((1, 9, count), float("-inf")),
            )
            if (count == 3) == (refused == "many"):
                with pytest.raises(ValueError, match="does not take these sizes"):
                    cpu_attention.attend_into(queries, prefix[0], 0.125, out, lse)
            else:
                cpu_attention.attend_into(queries, prefix[0], 0.125, out, lse)
                assert torch.isfinite(lse).all()
        # A step through the C++ operator: each request's own positions are one call of 6 rows a KV head, the prefix
        # both read another of 12; the one on the refusing build fails the step.
        batch = attention_module.PackedBatch.of(segments)
        with attention_module.packed_step(batch), pytest.raises(RuntimeError, match="does not take this step's sizes"):
            torch.ops.prefixgate.attend(query, key, value, 1, 0.125, None, None)
        few_rows_only = attention_module.PackedBatch.of(
            tuple(attention_module.Segment(own[i], 20, 2) for i in range(2))
        )
        with attention_module.packed_step(few_rows_only):
            if refused == "few":
                with pytest.raises(RuntimeError, match="does not take this step's sizes"):
                    torch.ops.prefixgate.attend(query, key, value, 1, 0.125, None, None)
            else:
                assert torch.isfinite(torch.ops.prefixgate.attend(query, key, value, 1, 0.125, None, None)).all()


def test_float32_calls_of_many_rows_run_on_the_avx512_build_where_the_cpu_has_it(caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        kernels = cpu_attention._library.__wrapped__(torch.float32)
    if kernels is None:
        pytest.skip("the float32 kernel does not run here")
    builds = cpu_attention._builds(torch.float32)
    assert kernels.few._name == str(cpu_attention.build(cpu_attention._SOURCES, builds[0]))  # AVX2
    assert kernels.many._name == str(cpu_attention.build(cpu_attention._SOURCES, builds[-1]))
    assert kernels.of(8) is kernels.few and kernels.of(9) is kernels.many
    if len(builds) == 2:
        assert "(AVX2 float32; AVX-512 float32 for calls of more than 8 rows)" in caplog.text
    else:
        assert kernels.many is kernels.few and "(AVX2 float32)" in caplog.text


@contextmanager
def operators_called() -> Iterator[set[str]]:
    """Profile the block; give the names of the `prefixgate` operators it called, once it ends."""
    called: set[str] = set()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
        yield called
    called.update(event.key for event in profiled.events() if event.key.startswith("prefixgate::"))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_a_step_on_a_shared_prefix_attends_with_the_kernel_as_with_torchs(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    prefix = torch.randn(2, 2, 3, 2048, 64).to(dtype)  # prefix: [layers, 2, kv_heads, positions, head_dim]
    buffers = torch.randn(3, 2, 2, 3, 64, 64).to(dtype)  # each request's own: [layers, 2, kv_heads, capacity, d]
    query = torch.randn(1, 9, 6, 64).to(dtype)  # 3 requests of 2 new tokens each
    key, value = torch.randn(2, 1, 3, 6, 64).to(dtype)
    # The same prefix in two runs, and a third after them (a document after a system prompt, say).
    first, second, child = prefix[:, :, :, :1024], prefix[:, :, :, 1024:], torch.randn(2, 2, 3, 64, 64).to(dtype)
    cases = [  # what each request reads, and the kernel's calls a layer
        ({0: (prefix,), 1: (prefix,)}, 1),  # the readers side by side in the step: their run joins the requests' call
        ({0: (prefix,), 2: (prefix,)}, 2),  # not side by side: gathered for a call of their own
        ({0: (first, second), 1: (first, second, child)}, 1),  # runs and a nested prefix, all in the requests' call
        ({0: (first, second, child), 2: (first, second)}, 3),  # gathered, then the nested one in a call after them
    ]
    for reads, calls in cases:
        held = {i: sum(run.shape[3] for run in runs) for i, runs in reads.items()}
        outputs, written, called = {}, {}, {}
        for operator in ("attend", "attend_torch"):
            own = buffers.clone()
            segments = tuple(
                attention_module.Segment(own[i], held[i] + 20, 2, held[i], reads[i])
                if i in reads
                else attention_module.Segment(own[i], 20, 2)
                for i in range(3)
            )
            batch = attention_module.PackedBatch.of(segments)
            assert 1 + attention_module._kernel_layout(batch).laid_out.groups == calls
            with attention_module.packed_step(batch), operators_called() as called[operator]:
                outputs[operator] = getattr(torch.ops.prefixgate, operator)(query, key, value, 1, 0.125, None, None)
            written[operator] = own
        assert "prefixgate::attend_torch" not in called["attend"]  # the kernel attended it, in the C++ operator
        torch.testing.assert_close(outputs["attend"], outputs["attend_torch"], **close(dtype))
        assert torch.equal(written["attend"], written["attend_torch"])  # the new keys and values, where they belong


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
async def test_requests_on_a_shared_prefix_give_the_tokens_they_give_alone(
    dtype: torch.dtype,
    make_backend: BackendFactory,
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Heads of 64, which both builds take. In bfloat16 every path rounds in its own places, so greedy tokens agree
    # only away from near-ties: seed 0 has one at the sixth token (float32 logits 6.52 against 6.29, bfloat16 ones
    # within a unit of 0.03) that the one buffer and the kernel resolve differently; seed 1 has none.
    model = make_llama(tokenizer, head_dim=64, seed=1).to(dtype)
    backend = shared_backend(make_backend, model=model)
    prompt = make_prompt(60)
    alone = (await collect(backend, prompt)).token_ids
    blocks = await prefix_blocks(backend, prompt)
    lay_out, layouts = attention_module._kernel_layout, []

    def recorded(batch: attention_module.PackedBatch) -> cpu_attention.StepLayout:
        layouts.append(lay_out(batch))
        return layouts[-1]

    monkeypatch.setattr(attention_module, "_kernel_layout", recorded)
    assert await run_shared(backend, prompt, blocks[:6]) == alone
    # Every step laid out for the kernel: the request's own positions, and the 6 shared blocks, which `start_shared`
    # lends as two runs of 3 blocks each.
    assert layouts and all(len(layout.own.parts) == 1 for layout in layouts)
    assert [[part.tokens for part in readers.plan.parts] for layout in layouts for readers in layout.readers] == [
        [3 * 8, 3 * 8]
    ] * len(layouts)


SHAPE = (2, 2, 2, 320, 64)  # a request's buffer in the tiny Llama with heads of 64: [layers, 2, kv_heads, positions, d]


def prefilled(tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype) -> tuple[ModelRunner, list[int], torch.Tensor]:
    """Return a runner of the tiny Llama with heads of 64 (the kernel's), a 300-token prompt, and a buffer holding
    its first 256 positions' K and V."""
    model = make_llama(tokenizer, head_dim=64).to(dtype)
    model.set_attn_implementation(attention_module.NAME)
    runner = ModelRunner(model)
    prompt = make_prompt(300)
    first = torch.zeros(SHAPE, dtype=dtype)
    with torch.inference_mode():
        runner.run([StepInput(prompt[:256], first, 0)])
    return runner, prompt, first


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_steps_with_the_kernel_give_the_logits_of_torchs_kernels_for_prefill_and_decode_shared_or_not(
    dtype: torch.dtype, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, prompt, first = prefilled(tokenizer, dtype)
    prefix = first[:, :, :, :256].clone()  # a cached prefix: read in place by one request, copied by the other
    logits = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(cpu_attention, "_library", lambda dtype: None)
        own, whole = torch.zeros(SHAPE, dtype=dtype), first.clone()
        steps = [
            # A prompt chunk after the prefix, then a decode step, of each at once.
            [StepInput(prompt[256:299], own, 256, 256, (prefix,)), StepInput(prompt[256:299], whole, 256)],
            [StepInput(prompt[299:], own, 299, 256, (prefix,)), StepInput(prompt[299:], whole, 299)],
        ]
        with torch.inference_mode(), operators_called() as called:
            logits[kernel] = torch.cat([runner.run(step) for step in steps])
        assert ("prefixgate::attend_torch" in called) is not kernel  # the C++ operator's kernel, or torch's
    # In bfloat16 the paths round at different places: a few of its units at the logits' size (on a shared prefix
    # torch's flash kernel lands 2.5 units from one buffer here, the C kernel 2.25). In float32, as the shared prefix's
    # tests hold torch's kernels to one buffer.
    unit = 2.0 ** (torch.floor(torch.log2(logits[False].abs().max())) - 7)
    atol = 4 * unit.item() if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(logits[True], logits[False], atol=atol, rtol=0)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_a_step_packs_the_readers_of_a_prefix_side_by_side_and_gives_logits_in_the_inputs_order(
    dtype: torch.dtype, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Requests on a shared prefix and requests without one, alternating in a step: the readers are packed together,
    # so their prefix joins the step's one kernel call, and each input's logits are where the input was.
    runner, prompt, first = prefilled(tokenizer, dtype)
    prefix = (first[:, :, :, :256].clone(),)
    own = [torch.zeros(SHAPE, dtype=dtype) for _ in range(4)]
    steps = [  # a chunk of each, then a token of each: readers first, third; the others read nothing shared
        [
            StepInput(prompt[256 + i : 280 + i], kv, 256, 256, prefix)
            if i % 2 == 0
            else StepInput(prompt[i : 24 + i], kv, 0)
            for i, kv in enumerate(own)
        ],
        [
            StepInput([prompt[280 + i]], kv, 280, 256, prefix) if i % 2 == 0 else StepInput([prompt[24 + i]], kv, 24)
            for i, kv in enumerate(own)
        ],
    ]
    calls: list[int] = []  # the kernel's calls a layer of each step
    laid_out = attention_module._kernel_layout

    def counted(batch: attention_module.PackedBatch) -> cpu_attention.StepLayout:
        layout = laid_out(batch)
        calls.append(1 + layout.laid_out.groups)
        return layout

    monkeypatch.setattr(attention_module, "_kernel_layout", counted)
    with torch.inference_mode():
        together = [runner.run(step) for step in steps]
        assert calls == [1, 1]  # the readers side by side: their prefix in the requests' own call
        alone = [torch.cat([runner.run([one]) for one in step]) for step in steps]
    for logits, expected in zip(together, alone, strict=True):
        torch.testing.assert_close(logits, expected, atol=1e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_dtypes_and_heads_it_does_not_take_go_to_torchs_kernel() -> None:
    assert not cpu_attention.applies(torch.randn(1, 3, 4, 64).half(), torch.randn(2, 3, 64, 64).half())
    assert not cpu_attention.applies(torch.randn(1, 3, 4, 16).bfloat16(), torch.randn(2, 3, 64, 16).bfloat16())
    assert not cpu_attention.applies(torch.randn(1, 3, 4, 8), torch.randn(2, 3, 64, 8))
    assert not cpu_attention.applies(torch.randn(1, 3, 4, 64), torch.randn(2, 3, 64, 64).bfloat16())
    assert not cpu_attention.prepare(torch.float16)
    assert not cpu_attention.takes(torch.randn(1, 2, 3, 64, 64).half())  # buffers: [layers, 2, kv_heads, capacity, d]
    assert not cpu_attention.takes(torch.randn(1, 2, 3, 64, 8))
    assert not cpu_attention.takes(torch.randn(1, 2, 3, 64, 128)[..., :64])  # rows of d not contiguous


def test_without_a_cxx_compiler_steps_attend_with_torchs_kernels_and_the_log_says_why(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        assert cpu_attention._operator.__wrapped__() is None
    assert "packed steps attend with torch's kernels: the operator that calls the C kernel needs a C++ compiler" in (
        caplog.text
    )
    monkeypatch.setattr(cpu_attention, "_operator", lambda: None)
    assert not cpu_attention.prepare(torch.float32) and not cpu_attention.takes(torch.zeros(1, 2, 2, 8, 64))
    monkeypatch.setattr(attention_module, "_kernel_layout", lambda batch: pytest.fail("a step laid out for the kernel"))
    model = make_llama(tokenizer, head_dim=64)
    model.set_attn_implementation(attention_module.NAME)
    with torch.inference_mode():
        logits = ModelRunner(model).run([StepInput(make_prompt(20), torch.zeros(2, 2, 2, 32, 64), 0)])
    assert logits.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_NAME)
def test_without_a_compiler_or_when_it_fails_the_kernel_is_not_used_and_the_log_says_why(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    if cpu_attention.unavailable(dtype) not in (None, "needs a C compiler: none found as $CC, cc or gcc"):
        pytest.skip(f"the kernel cannot run on this machine anyway: {cpu_attention.unavailable(dtype)}")
    monkeypatch.setattr(cpu_attention, "kernel_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    name = str(dtype).removeprefix("torch.")
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        assert cpu_attention._library.__wrapped__(dtype) is None
    assert f"packed steps in {name} attend with torch's kernels: the C kernel building it failed" in caplog.text
    assert not list(tmp_path.glob("*.so"))
    monkeypatch.delenv("CC")
    monkeypatch.setattr(cpu_attention.shutil, "which", lambda name: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        assert cpu_attention._library.__wrapped__(dtype) is None
    assert "needs a C compiler: none found as $CC, cc or gcc" in caplog.text


@needs_bfloat16_kernel
def test_where_the_amx_build_fails_the_avx512_build_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    # A CPU said to have AMX, and an AMX build the compiler refuses (a flag it does not know): the other build runs.
    monkeypatch.setattr(cpu_attention, "kernel_dir", lambda: tmp_path)
    monkeypatch.setattr(
        cpu_attention, "cpu_flags", lambda: frozenset(cpu_attention._CPU_FLAGS + ("amx_tile", "amx_bf16"))
    )
    monkeypatch.setattr(cpu_attention, "_AMX_FLAGS", ("-mamx-tile", "-mno-such-option"))
    with caplog.at_level(logging.INFO, logger=cpu_attention.__name__):
        library = cpu_attention._library.__wrapped__(torch.bfloat16)
    assert library is not None
    plain = cpu_attention.build_name(cpu_attention._builds(torch.bfloat16)[0])  # on FMAs on Intel's CPUs
    assert f"attend with the C kernel ({plain}); building it failed" in caplog.text
    assert "(AMX)" in caplog.text
    monkeypatch.setattr(cpu_attention, "_library", lambda dtype: library)
    queries, kv = torch.randn(1, 9, 4, 64).bfloat16(), torch.randn(2, 3, 300, 64).bfloat16()
    out, lse = torch.zeros(1, 9, 4, 64).bfloat16(), torch.full((1, 9, 4), float("-inf"))
    cpu_attention.attend_into(queries, kv, 0.125, out, lse)
    expected, expected_lse = reference(queries, kv[0], kv[1], 0.125)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2**-7)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=DTYPE_NAME)
def test_the_kernel_is_built_once_per_source(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_attention, "kernel_dir", lambda: tmp_path)
    assert cpu_attention._library.__wrapped__(dtype) is not None
    built = {path: path.stat().st_mtime_ns for path in tmp_path.glob("cpu_attention-*.so")}
    assert built  # float32 on a CPU with AVX-512: two builds
    assert cpu_attention._library.__wrapped__(dtype) is not None
    assert {path: path.stat().st_mtime_ns for path in tmp_path.glob("cpu_attention-*.so")} == built


@needs_bfloat16_kernel
def test_torchs_own_users_of_the_matrix_tiles_run_as_before_between_kernel_calls() -> None:
    # The kernel sets the tiles up and releases them on each of its threads; torch's flash kernel and oneDNN's
    # products set them up their own way on the same threads. Interleaved, each gives what it gave alone.
    torch.manual_seed(0)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, k, v = (torch.randn(1, 8, n, 64).bfloat16() for n in (256, 2048, 2048))
    x, w = torch.randn(256, 576).bfloat16(), torch.randn(1536, 576).bfloat16()
    kv, queries = torch.randn(2, 3, 2048, 64).bfloat16(), torch.randn(1, 9, 8, 64).bfloat16()

    def kernel() -> torch.Tensor:
        out, lse = torch.zeros(1, 9, 8, 64).bfloat16(), torch.full((1, 9, 8), float("-inf"))
        cpu_attention.attend_into(queries, kv, 0.125, out, lse)
        return out

    with torch.inference_mode():
        alone = flash(q, k, v, 0.0, False)[0].clone(), torch.nn.functional.linear(x, w), kernel()
        for _ in range(10):
            assert torch.equal(flash(q, k, v, 0.0, False)[0], alone[0])
            assert torch.equal(kernel(), alone[2])
            assert torch.equal(torch.nn.functional.linear(x, w), alone[1])
            assert torch.equal(kernel(), alone[2])


def test_the_kernels_order_is_offered_only_where_its_build_reads_it_and_blocks_hold_whole_groups() -> None:
    builds = cpu_attention._library(torch.bfloat16)
    reads = builds is not None and cpu_attention.prepare(torch.bfloat16) and builds.few.prefixgate_takes_tiles() == 1
    assert (cpu_attention.slot_order(torch.bfloat16, 64, 64) is not None) == reads
    assert cpu_attention.slot_order(torch.bfloat16, 64, 48) is None  # blocks of whole groups of 32 positions only
    assert cpu_attention.slot_order(torch.bfloat16, 80, 64) is None  # heads the bfloat16 kernel does not take
    assert cpu_attention.slot_order(torch.float32, 64, 64) is None
