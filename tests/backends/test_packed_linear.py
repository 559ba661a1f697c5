"""Prepacked linear layers: a model on a CPU computes what it computed before, from a layout made once (oneDNN's in
bfloat16 where oneDNN computes it; float32 in the C++ kernel's on AMD's CPUs, or oneDNN's where that does not build,
and elsewhere GGUF codes in the kernel's for up to 64 rows, MKL's products past them)."""

from __future__ import annotations

import copy
import gc
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, SamplingParams, cpu_attention, packed_linear
from prefixgate.backends.packed_linear import PackedLinear, applies, block_codes, packs, prepack_linear_weights
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.tiny_models import as_blocks, make_llama

PACKED = [dtype for dtype in (torch.bfloat16, torch.float32) if packs(dtype)]  # what this CPU packs
# A packed product is at most a unit in the last place from the plain one where the kernels sum in another order.
LAST_PLACE = {torch.bfloat16: 2**-7, torch.float32: 2**-20}
on_packing_cpus = pytest.mark.skipif(not PACKED, reason="this CPU or torch build packs no linear weights")
packed_dtypes = pytest.mark.parametrize("dtype", PACKED, ids=str)


@on_packing_cpus
@packed_dtypes
@pytest.mark.parametrize("rows", [1, 8, 65, 300])
@pytest.mark.parametrize(("features", "bias"), [((96, 160), True), ((37, 50), False)], ids=["96x160", "37x50"])
def test_a_packed_layer_gives_what_the_plain_one_gives(
    rows: int, features: tuple[int, int], bias: bool, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(*features, bias=bias).to(dtype)
    x = torch.randn(2, rows, features[0], dtype=dtype)  # x: [batch, rows, in_features]
    with torch.inference_mode():
        expected = linear(x)
        out = PackedLinear(linear)(x)
    assert out.shape == expected.shape == (2, rows, features[1])
    torch.testing.assert_close(out, expected, atol=LAST_PLACE[dtype], rtol=LAST_PLACE[dtype])


needs_float32_kernel = pytest.mark.skipif(
    not packed_linear._kernel(), reason="the float32 linear kernel does not build here (AVX2, FMA, a C++ compiler)"
)


@needs_float32_kernel
def test_float32_layers_run_on_the_c_kernel_where_it_builds_and_on_onednn_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    linear = torch.nn.Linear(64, 48)
    assert PackedLinear(linear).layout.keys() == {"panels", "bias"}
    monkeypatch.setattr(packed_linear, "_kernel", lambda: False)
    onednn = PackedLinear(linear)
    assert onednn.description is None and not onednn.layout
    x = torch.randn(3, 64)
    with torch.inference_mode():
        torch.testing.assert_close(onednn(x), linear(x), atol=LAST_PLACE[torch.float32], rtol=LAST_PLACE[torch.float32])


@needs_float32_kernel
def test_the_float32_kernels_operator_refuses_rows_it_cannot_take_and_says_what_it_takes() -> None:
    layer = PackedLinear(torch.nn.Linear(64, 48))
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="takes rows of 64 values"):
            layer(torch.randn(3, 32))
        with pytest.raises(RuntimeError, match="takes float32 rows"):
            layer(torch.randn(3, 64, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="has 48 outputs, not 47"):
            torch.ops.prefixgate.linear_panels(torch.randn(3, 64), layer.number, 47)
        assert layer(torch.randn(0, 64)).shape == (0, 48)  # no rows: no product, and an empty output
        number = layer.number
        del layer
        gc.collect()
        with pytest.raises(RuntimeError, match=f"no live layer is described as number {number}"):
            torch.ops.prefixgate.linear_panels(torch.randn(3, 64), number, 48)  # its layouts went with it


GGUF_BLOCKS = [
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
]


def gguf_weight(shape: tuple[int, int], qtype: GGMLQuantizationType, seed: int = 0) -> torch.Tensor:
    """A float32 weight as transformers loads a GGUF file's weight of `qtype`: gguf's own quantizer and dequantizer
    (what made the embedded model's file, and what reads it)."""
    weight = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(weight, qtype), qtype)))


def rounded_from_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.nn.Linear]:
    """A float32 GGUF weight of `shape` ([out, in]) and a bfloat16 layer (with a bias) whose weight is its rounding."""
    original = gguf_weight(shape, qtype)
    linear = torch.nn.Linear(shape[1], shape[0]).to(torch.bfloat16)
    linear.weight.data = original.bfloat16()
    return original, linear


@needs_float32_kernel
@pytest.mark.parametrize("rows", [1, 7, 65])
@pytest.mark.parametrize("qtype", GGUF_BLOCKS, ids=lambda qtype: qtype.name)
def test_a_gguf_block_weight_is_held_as_codes_and_gives_the_float_panels_products_to_the_bit(
    qtype: GGMLQuantizationType, rows: int
) -> None:
    linear = torch.nn.Linear(160, 37)  # 37 output features: the last panel is partial
    linear.weight.data = gguf_weight((37, 160), qtype)
    codes, floats = PackedLinear(linear), PackedLinear(linear, codes=False)
    assert "panels" not in codes.layout
    held = codes.layout["codes"]  # 37 features padded to 48; Q4_1's codes are 0 to 15, two to a byte
    if qtype == GGMLQuantizationType.Q4_1:
        assert (held.dtype, held.numel()) == (torch.uint8, 48 * 160 // 2)
    else:
        assert (held.dtype, held.numel()) == (torch.int8, 48 * 160)
    assert "panels" in floats.layout
    x = torch.randn(2, rows, 160)
    with torch.inference_mode():
        out = codes(x)
        assert torch.equal(out, floats(x))
        expected = linear(x)
    torch.testing.assert_close(out, expected, atol=LAST_PLACE[torch.float32], rtol=LAST_PLACE[torch.float32])


@pytest.mark.parametrize("slice_", [2**19, 100], ids=["one slice", "slices of 100 blocks"])
def test_block_codes_rebuild_every_block_exactly_in_whichever_form_it_has(
    slice_: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed_linear, "_SLICE", slice_)
    # 320 blocks of Q4_1 (past the first 256, which choose the order forms are tried in), then 4 rows of each form
    weight = torch.cat(
        [gguf_weight((160, 64), GGMLQuantizationType.Q4_1)] + [gguf_weight((4, 64), q) for q in GGUF_BLOCKS]
    )
    found = block_codes(weight)
    assert found is not None
    q, d, o = found
    assert q.dtype == torch.int8 and q.shape == weight.shape and d.shape == o.shape == (180, 2)
    assert torch.equal(d, d.half().float())  # so d q is exact in float32, and the kernel's FMA rounds once
    assert torch.equal(d.repeat_interleave(32, 1) * q + o.repeat_interleave(32, 1), weight)
    assert block_codes(torch.zeros(4, 64)) is not None  # blocks of one value


@pytest.mark.parametrize("slice_", [2**19, 100], ids=["one slice", "slices of 100 blocks"])
def test_weights_that_are_not_exactly_gguf_blocks_are_not_codes(slice_: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "_SLICE", slice_)
    weight = gguf_weight((160, 64), GGMLQuantizationType.Q4_1)
    for row in (3, 150):  # among the first 256 blocks, and past them
        off = weight.clone()
        off[row, 40] = torch.nextafter(off[row, 40], torch.tensor(1.0))
        assert block_codes(off) is None
    assert block_codes(torch.randn(64, 64)) is None  # a model's own float32 weight
    assert block_codes(torch.zeros(4, 48)) is None  # no whole blocks of 32
    assert block_codes(weight.double()) is None


def test_where_the_float32_kernel_cannot_be_built_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if cpu_attention.unavailable(torch.float32) not in (None, "needs a C compiler: none found as $CC, cc or gcc"):
        pytest.skip(f"the kernel cannot run on this machine anyway: {cpu_attention.unavailable(torch.float32)}")
    monkeypatch.setattr(cpu_attention, "kernel_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        assert packed_linear._kernel.__wrapped__() is False
    assert "linear layers run on oneDNN's and torch's products alone: the C++ kernel building it failed" in caplog.text
    assert not list(tmp_path.glob("*.so"))


@needs_float32_kernel
def test_a_float32_rows_output_is_the_same_to_the_bit_whatever_rows_are_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where the kernel takes every row (AMD's CPUs), each output is summed over the inputs in one order, whatever the
    # batch: a request's logits do not depend on the requests stepped with it.
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")
    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(200, 70))
    assert layer.plain is None
    x = torch.randn(130, 200)  # past one group of 64 rows
    with torch.inference_mode():
        together = layer(x)
        for row in (0, 5, 6, 63, 64, 129):
            assert torch.equal(layer(x[row : row + 1]), together[row : row + 1])
            assert torch.equal(layer(x[row - 3 if row >= 3 else 0 : row + 1])[-1], together[row])


@needs_float32_kernel
@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
def test_where_mkl_serves_prompts_more_than_64_rows_get_torchs_own_product_and_fewer_the_kernels(
    vendor: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: vendor)
    linear = torch.nn.Linear(1536, 37)  # a long sum: torch's and the kernel's orders of it differ in the last place
    linear.weight.data = gguf_weight((37, 1536), GGMLQuantizationType.Q8_0)
    layer = PackedLinear(linear)
    assert (layer.plain is not None) is (vendor == "GenuineIntel") and "codes" in layer.layout
    x = torch.randn(65, 1536)
    with torch.inference_mode():
        own, kernel = linear(x), torch.cat([layer(x[:64]), layer(x[64:])])  # 64 rows and 1: the kernel's
        assert not torch.equal(own, kernel)
        assert torch.equal(layer(x), own if vendor == "GenuineIntel" else kernel)


needs_bfloat16_kernel = pytest.mark.skipif(
    not packed_linear.bfloat16_products(), reason="the linear kernel has no bfloat16 products here (AVX-512 BF16)"
)


def in_pairs_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) in bfloat16 as the kernel sums it: in float32, over k two values at a time, the second's product
    and then the first's (each exact in float32, each added in one rounding), the bias last, then rounded once."""
    xs, ws = x.float(), weight.float()
    sums = torch.zeros(x.shape[0], weight.shape[0])
    for i in range(0, x.shape[1], 2):
        sums = sums + xs[:, i + 1, None] * ws[None, :, i + 1]
        sums = sums + xs[:, i, None] * ws[None, :, i]
    return (sums + bias.float() if bias is not None else sums).bfloat16()


@needs_bfloat16_kernel
@pytest.mark.parametrize(("features", "bias"), [((160, 37), True), ((1536, 70), False)], ids=["160x37", "1536x70"])
def test_a_bfloat16_layer_gives_up_to_pair_rows_the_kernels_sums_and_more_onednns_product(
    features: tuple[int, int], bias: bool
) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(*features, bias=bias).to(torch.bfloat16)
    layer = PackedLinear(linear)
    assert "pairs" in layer.layout and layer.description is not None
    most = packed_linear.pair_rows()  # 8 with AMX, 64 on dot products without it, every count (None) on FMAs
    # the kernel: its own order of sums, whatever rows are beside them; past `most`, oneDNN's product
    kernels, onednns = ((1, 5, 8, most), (most + 1, most + 32)) if most else ((1, 5, 8, 64, 65, 160), ())
    x = torch.randn(max(kernels + onednns), features[0], dtype=torch.bfloat16)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as ran:
        for rows in kernels:
            assert torch.equal(layer(x[:rows]), in_pairs_order(x[:rows], linear.weight, linear.bias))
        for rows in onednns:  # the Python operator's product on oneDNN's layout
            assert torch.equal(layer(x[:rows]), torch.ops.prefixgate.packed_linear(x[:rows], layer.number))
        if features[0] == 1536 and packed_linear.amx_products():  # a long sum, which oneDNN orders otherwise on the
            onednn = torch.ops.prefixgate.packed_linear(x[:40], layer.number)  # tiles: the two differ somewhere
            assert not torch.equal(onednn, in_pairs_order(x[:40], linear.weight, linear.bias))
    calls = {event.key: event.count for event in ran.key_averages()}
    assert calls["prefixgate::linear_panels"] == 6  # each of the layer's products, through the kernel's operator
    onednn = 2 * len(onednns) + (features[0] == 1536 and packed_linear.amx_products())
    assert calls.get("mkldnn::_linear_pointwise", 0) == onednn
    with torch.inference_mode(), pytest.raises(RuntimeError, match="takes bfloat16 rows"):
        layer(x.float())


on_tiles = pytest.mark.skipif(not packed_linear.amx_products(), reason="the linear kernel runs no AMX tiles here")
off_tiles = pytest.mark.skipif(packed_linear.amx_products(), reason="the linear kernel runs AMX tiles here")


@needs_bfloat16_kernel
@off_tiles
@pytest.mark.parametrize("qtype", GGUF_BLOCKS, ids=lambda qtype: qtype.name)
def test_a_bfloat16_layer_rounded_from_gguf_blocks_reads_their_codes_and_gives_the_pair_panels_bits(
    qtype: GGMLQuantizationType,
) -> None:
    # 37 output features: the last panel is partial; a long sum, which oneDNN orders otherwise than the pair panels
    original, linear = rounded_from_blocks((37, 1536), qtype)
    coded, paired = PackedLinear(linear, found=block_codes(original)), PackedLinear(linear)
    assert {"codes", "pairs"} <= coded.layout.keys() and "codes" not in paired.layout
    assert coded.layout["codes"].nbytes < paired.layout["pairs"].nbytes
    most = packed_linear.pair_rows()  # None: every count on the pair panels
    onednns = (most + 1, most + 32) if most else ()
    x = torch.randn(max((most or 160, *onednns)), 1536, dtype=torch.bfloat16)
    with torch.inference_mode():
        # rebuilt pairs of weights to 5 rows, pair panels to `pair_rows()`: the same sums, to the bit
        for rows in (*range(1, 9), 16, most or 160):
            assert torch.equal(coded(x[:rows]), paired(x[:rows]))
            assert torch.equal(coded(x[:rows]), in_pairs_order(x[:rows], linear.weight, linear.bias))
        for rows in onednns:  # oneDNN's product on its layout
            assert torch.equal(coded(x[:rows]), torch.ops.prefixgate.packed_linear(x[:rows], coded.number))
        with profile(activities=[ProfilerActivity.CPU]) as ran:
            for rows in (1, 5, 6, 8, most or 160, *onednns):
                coded(x[:rows])
    calls = {event.key: event.count for event in ran.key_averages()}
    assert calls["prefixgate::linear_panels"] == 5 + len(onednns)
    assert calls.get("mkldnn::_linear_pointwise", 0) == len(onednns)


@on_tiles
@pytest.mark.parametrize("qtype", GGUF_BLOCKS, ids=lambda qtype: qtype.name)
def test_with_amx_a_bfloat16_layer_rounded_from_gguf_blocks_gives_2_to_512_rows_products_of_its_codes_on_the_tiles(
    qtype: GGMLQuantizationType,
) -> None:
    # 37 output features: the last panel is partial, and past 64 rows the last of the panels taken two at a time alone
    original, linear = rounded_from_blocks((37, 1536), qtype)
    layer = PackedLinear(linear, found=block_codes(original))
    assert "codes" in layer.layout and "pairs" not in layer.layout  # which no count of rows would read
    x = torch.randn(513, 1536, dtype=torch.bfloat16)
    counts = (1, 5, 8, 16, 17, 40, 64, 65, 80, 100, 512)
    with torch.inference_mode():
        exact = (x.double() @ linear.weight.double().T + linear.bias.double()).float()
        # 2 to 512 rows on the tiles (one row on the code panels): up to 64, 16 rows at a time and what is left, then
        # 32 at a time and what is left; the codes rebuilt as the pair panels hold them, the sums in float32 rounded
        # once, a unit in the last place at most from the exact product; past 512 rows oneDNN's product
        for rows in counts:
            torch.testing.assert_close(layer(x[:rows]).float(), exact[:rows], atol=2**-7, rtol=2**-7)
        assert torch.equal(layer(x[:100])[:64], layer(x[:64]))  # each output summed in the same order either way
        assert torch.equal(layer(x[:513]), torch.ops.prefixgate.packed_linear(x[:513], layer.number))
        layer.layout["scales"].zero_()  # the codes' d and o, read by every count to 512: each row now the bias alone
        layer.layout["offsets"].zero_()
        assert all(torch.equal(layer(x[:rows]), linear.bias.expand(rows, -1)) for rows in counts)
        with profile(activities=[ProfilerActivity.CPU]) as ran:
            for rows in (1, 8, 64, 65, 512, 513):
                layer(x[:rows])
    calls = {event.key: event.count for event in ran.key_averages()}
    assert calls["prefixgate::linear_panels"] == 6 and calls["mkldnn::_linear_pointwise"] == 1


AMX_REFUSED = """
from prefixgate.backends import cpu_attention, packed_linear
flags = cpu_attention.cpu_flags()
cpu_attention.cpu_flags = lambda: flags | {"amx_tile", "amx_bf16"}  # a CPU with AMX
packed_linear._AMX_FLAGS = ("-mamx-no-such-instructions",)  # and a compiler that cannot build for it
assert packed_linear._AMX_FLAGS[0] in packed_linear._flags()
assert packed_linear._kernel() and packed_linear.bfloat16_products() and not packed_linear.amx_products()
assert "-mavx512bf16" in packed_linear._built[0]
"""


@needs_bfloat16_kernel
def test_where_the_compiler_cannot_build_amxs_tiles_the_kernel_is_built_without_them() -> None:
    ran = subprocess.run([sys.executable, "-c", AMX_REFUSED], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-2000:]


@needs_bfloat16_kernel
@off_tiles
def test_a_bfloat16_layers_code_panels_take_up_to_5_rows_and_its_pair_panels_from_6_to_pair_rows() -> None:
    original, linear = rounded_from_blocks((37, 160), GGMLQuantizationType.Q8_0)
    layer = PackedLinear(linear, found=block_codes(original))
    counts = (*range(1, 9), packed_linear.pair_rows() or 160)
    x = torch.randn(counts[-1], 160, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = [layer(x[:rows]) for rows in counts]
        layer.layout["codes"].zero_()  # each layout now gives its own answer: the codes' all the bias
        assert all(torch.equal(layer(x[:rows]), linear.bias.expand(rows, -1)) for rows in range(1, 6))
        layer.layout["pairs"].zero_()
        assert all(torch.equal(layer(x[:rows]), linear.bias.expand(rows, -1)) for rows in counts[5:])
    assert not any(torch.equal(rows, linear.bias.expand(len(rows), -1)) for rows in before)


@needs_bfloat16_kernel
def test_a_bfloat16_layer_whose_codes_do_not_rebuild_it_keeps_the_pair_panels() -> None:
    original, linear = rounded_from_blocks((37, 160), GGMLQuantizationType.Q8_0)
    linear.weight.data[5, 9] += 1  # no longer the rounding of the weight the codes rebuild
    layer = PackedLinear(linear, found=block_codes(original))
    assert "pairs" in layer.layout and "codes" not in layer.layout  # pair panels alone
    x = torch.randn(3, 160, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), in_pairs_order(x, linear.weight, linear.bias))


@needs_bfloat16_kernel
def test_a_bfloat16_model_loaded_from_gguf_blocks_reads_its_folders_float32_weights_as_codes(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    saved = as_blocks(make_llama(tokenizer, tie_word_embeddings=True), torch.float32)  # as a converted GGUF model
    saved.save_pretrained(tmp_path)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")  # beside them, unreadable: passed over
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    paired = copy.deepcopy(loaded)
    paired.name_or_path = ""  # the same bfloat16 weights with no folder: pair panels
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        assert prepack_linear_weights(loaded) == prepack_linear_weights(paired) > 0
    layers = [m for m in loaded.modules() if isinstance(m, PackedLinear)]
    assert all("codes" in layer.layout for layer in layers)  # the output projection too, tied to the embeddings
    assert not any("codes" in m.layout for m in paired.modules() if isinstance(m, PackedLinear))
    assert f"{len(layers)} of {len(layers)} bfloat16 linear layers also read the GGUF codes" in caplog.text
    assert "broken.safetensors are not read as codes" in caplog.text
    with torch.inference_mode():
        for tokens in (3, 40):  # on the codes, and on oneDNN's layout: the same bits
            ids = torch.tensor([make_prompt(tokens)])
            assert torch.equal(loaded(ids).logits, paired(ids).logits)


@needs_bfloat16_kernel
def test_a_bfloat16_model_whose_float32_weights_are_no_codes_reads_only_their_first_rows_and_keeps_pair_panels(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a model's own float32 weights, each more than the 256 blocks of 32 values the first rows hold
    make_llama(tokenizer, hidden_size=256, intermediate_size=512, num_key_value_heads=4).save_pretrained(tmp_path)
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")  # beside them, unreadable
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    looked_at: list[tuple[int, ...]] = []
    real = packed_linear.block_codes
    monkeypatch.setattr(packed_linear, "block_codes", lambda weight: looked_at.append(weight.shape) or real(weight))
    full = {tuple(m.weight.shape) for m in loaded.modules() if type(m) is torch.nn.Linear}
    assert prepack_linear_weights(loaded) > 0
    layers = [m for m in loaded.modules() if isinstance(m, PackedLinear)]
    assert all("pairs" in layer.layout and "codes" not in layer.layout for layer in layers)
    assert looked_at and not full & set(looked_at)  # each weight's first rows, never a whole one


def test_a_float32_original_gone_since_it_was_listed_gives_no_codes_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        assert packed_linear._original_codes((tmp_path / "gone.safetensors", "lm_head.weight")) is None
    assert "the float32 weight lm_head.weight of" in caplog.text and "is not read as codes" in caplog.text


@needs_bfloat16_kernel
def test_bfloat16_layers_get_the_kernels_layout_only_where_it_takes_an_eighth_of_the_free_memory_at_most(
    llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # pair panels beside oneDNN's layout, as on AMD's CPUs and with AMX (on FMAs they replace it: the next test)
    monkeypatch.setattr(packed_linear, "pair_rows", lambda: 64)
    model = copy.deepcopy(llama).to(torch.bfloat16)
    model.add_module("odd", torch.nn.Linear(37, 50).to(torch.bfloat16))  # an odd width: oneDNN's layout alone
    probe = copy.deepcopy(model)
    with monkeypatch.context() as plenty:  # memory enough for any copy: the layout the rule weighs
        plenty.setattr(packed_linear.os, "sysconf", lambda name: 1 << 40 if name == "SC_AVPHYS_PAGES" else 4096)
        prepack_linear_weights(probe)
    weights = sum(
        m.layout["pairs"].nbytes for m in probe.modules() if isinstance(m, PackedLinear) and "pairs" in m.layout
    )
    page = 4096
    for pages, paired in [(8 * weights // page + 1, True), (8 * weights // page - 1, False)]:  # just above, below
        monkeypatch.setattr(
            packed_linear.os, "sysconf", lambda name, pages=pages: pages if name == "SC_AVPHYS_PAGES" else page
        )
        packed = copy.deepcopy(model)
        with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
            assert prepack_linear_weights(packed) > 0
        layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
        assert all(("pairs" in layer.layout) is (paired and layer.in_features % 2 == 0) for layer in layers)
        assert ("bfloat16 linear layers stay oneDNN's alone" in caplog.text) is not paired
        caplog.clear()


@needs_bfloat16_kernel
@pytest.mark.skipif(packed_linear.pair_rows() is not None, reason="the pair panels take a bounded count of rows here")
def test_where_the_pair_panels_take_every_count_of_rows_they_replace_onednns_layout_whatever_the_free_memory(
    llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = copy.deepcopy(llama).to(torch.bfloat16)
    model.add_module("odd", torch.nn.Linear(37, 50).to(torch.bfloat16))  # an odd width: oneDNN's layout alone
    lone = torch.nn.Linear(64, 48).to(torch.bfloat16)  # three panels of 16 outputs: the last one met alone
    weight = lone.weight.detach().clone()
    model.add_module("lone", lone)
    # two pages free: no copy of the weights would fit, and the pair panels are no copy
    monkeypatch.setattr(packed_linear.os, "sysconf", lambda name: 2 if name == "SC_AVPHYS_PAGES" else 4096)
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        assert prepack_linear_weights(model) > 0
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert "instead of oneDNN's layout: it takes every step" in caplog.text
    for layer in layers:
        paired = layer.in_features % 2 == 0
        assert ("pairs" in layer.layout) is paired and (layer.packed is None) is paired
    layer = model.get_submodule("lone")
    assert isinstance(layer, PackedLinear)
    x = torch.randn(600, 64, dtype=torch.bfloat16)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as ran:
        for rows in (1, 8, 64, 65, 600):  # a decode step to a prompt's chunk past 512, all on the pair panels
            assert torch.equal(layer(x[:rows]), in_pairs_order(x[:rows], weight, layer.bias))
    assert "mkldnn::_linear_pointwise" not in {event.key for event in ran.key_averages()}


AVX2_PRODUCTS = """
import sys, torch
from prefixgate.backends import packed_linear
packed_linear._flags = lambda: packed_linear._FLAGS  # the AVX2 build, on a CPU that has AVX-512
packed_linear.cpu_vendor = lambda: "AuthenticAMD"  # the kernel for every row count
assert packed_linear._kernel()
linear, x = torch.load(sys.argv[1], weights_only=False)
layer = packed_linear.PackedLinear(linear)
cpu_attention = packed_linear.cpu_attention
built = cpu_attention.build_operator(packed_linear._SOURCE, packed_linear._flags(), cpu_attention.cxx_compiler())
with torch.inference_mode():
    torch.save(([layer(x[:rows]) for rows in (1, 7, 12, 13, 65)], built.name), sys.argv[2])
"""


@needs_float32_kernel
@pytest.mark.skipif("avx512f" not in (cpu_attention.cpu_flags() or ()), reason="needs a CPU with AVX-512")
def test_the_avx512_build_gives_the_avx2_builds_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "AuthenticAMD")  # the kernel for every row count
    torch.manual_seed(0)
    for linear in (torch.nn.Linear(200, 70), torch.nn.Linear(160, 37)):
        if linear.in_features == 160:
            linear.weight.data = gguf_weight((37, 160), GGMLQuantizationType.Q4_1)  # codes, two to a byte
        x = torch.randn(65, linear.in_features)
        torch.save((linear, x), tmp_path / "inputs.pt")
        subprocess.run(
            [sys.executable, "-c", AVX2_PRODUCTS, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
            check=True,
        )
        layer = PackedLinear(linear)
        with torch.inference_mode():
            ours = [layer(x[:rows]) for rows in (1, 7, 12, 13, 65)]
        theirs, avx2 = torch.load(tmp_path / "outputs.pt")
        ours_built = cpu_attention.build_operator(
            packed_linear._SOURCE, packed_linear._flags(), cpu_attention.cxx_compiler()
        )
        assert avx2 != ours_built.name  # another build than this process loaded
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


OTHER_BFLOAT16_PRODUCTS = """
import sys, torch
from prefixgate.backends import packed_linear
flags = packed_linear._flags()  # the other way: on FMAs where this CPU's build is not, on dot products where it is
other = flags[:-1] if flags[-1] == "-DON_FMA" else flags + ("-DON_FMA",)
packed_linear._flags = lambda: other
assert packed_linear.bfloat16_products()
(linear, found), x = torch.load(sys.argv[1], weights_only=False)
layers = [packed_linear.PackedLinear(linear, found=found), packed_linear.PackedLinear(linear)]
cpu_attention = packed_linear.cpu_attention
built = cpu_attention.build_operator(packed_linear._SOURCE, other, cpu_attention.cxx_compiler())
with torch.inference_mode():
    torch.save(([layer(x[:rows]) for layer in layers for rows in (1, 5, 8, 13, 64)], built.name), sys.argv[2])
"""


@needs_bfloat16_kernel
@off_tiles
def test_the_bfloat16_products_on_fmas_give_the_dot_products_bits(tmp_path: Path) -> None:
    # Each pair's second product added and then its first, each in one rounding, as `vdpbf16ps` adds them: the same
    # sums on float32 FMAs (as Intel's CPUs without AMX run them) as on the dot products (as AMD's do), for the code
    # panels (up to 5 rows) and the pair panels.
    original, linear = rounded_from_blocks((37, 1536), GGMLQuantizationType.Q4_1)
    found = block_codes(original)
    x = torch.randn(64, 1536, dtype=torch.bfloat16)
    torch.save(((linear, found), x), tmp_path / "inputs.pt")
    command = [sys.executable, "-c", OTHER_BFLOAT16_PRODUCTS, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")]
    subprocess.run(command, check=True)
    layers = [PackedLinear(linear, found=found), PackedLinear(linear)]
    assert "codes" in layers[0].layout and "codes" not in layers[1].layout
    with torch.inference_mode():
        ours = [layer(x[:rows]) for layer in layers for rows in (1, 5, 8, 13, 64)]
    theirs, other = torch.load(tmp_path / "out.pt")
    built = cpu_attention.build_operator(packed_linear._SOURCE, packed_linear._flags(), cpu_attention.cxx_compiler())
    assert other != built.name  # another build than this process loaded
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@on_packing_cpus
@packed_dtypes
def test_prepacking_replaces_every_plain_linear_layer_and_keeps_the_logits(
    llama: PreTrainedModel, dtype: torch.dtype
) -> None:
    model = as_blocks(copy.deepcopy(llama), dtype)
    plain = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.tensor([make_prompt(40)])
    with torch.inference_mode():
        expected = model(ids).logits
    assert applies(model)
    assert prepack_linear_weights(model) == plain > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    with torch.inference_mode():
        logits = model(ids).logits
    torch.testing.assert_close(logits, expected, atol=0.05, rtol=0.02)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_float32_is_packed_on_amd_cpus_and_elsewhere_where_the_kernel_builds_and_half_precision_nowhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        pytest.skip("this torch build has no oneDNN")
    for vendor, kernel, float32 in [
        ("AuthenticAMD", False, True),  # oneDNN's layout there, where the kernel does not build
        ("GenuineIntel", True, True),
        ("GenuineIntel", False, False),  # MKL's products, as before
        ("", False, False),
    ]:
        monkeypatch.setattr(packed_linear, "cpu_vendor", lambda vendor=vendor: vendor)
        monkeypatch.setattr(packed_linear, "_kernel", lambda kernel=kernel: kernel)
        assert packs(torch.float32) is float32
        assert not packs(torch.float16)


@needs_float32_kernel
def test_where_mkl_serves_prompts_float32_layers_that_are_not_codes_stay_plain(
    llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packed_linear, "cpu_vendor", lambda: "GenuineIntel")
    model = copy.deepcopy(llama)  # float32 weights that are not GGUF blocks
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert applies(model) and prepack_linear_weights(model) == 0
    assert [m for m in model.modules() if type(m) is torch.nn.Linear] == plain


def test_models_this_cpu_does_not_pack_and_backends_built_without_it_stay_unpacked(
    llama: PreTrainedModel, make_backend: BackendFactory
) -> None:
    float16 = copy.deepcopy(llama).to(torch.float16)
    assert not applies(float16) and prepack_linear_weights(float16) == 0
    assert applies(llama) is packs(torch.float32)
    backend: HFBackend = make_backend(copy.deepcopy(llama))
    assert backend.prepacked == 0


def test_a_backend_builds_the_linear_kernel_beside_the_attentions_and_packs_once_it_is_built(
    llama: PreTrainedModel, make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    built_on, packed_after = [], []  # the thread that built it; whether packing came after the build ended
    attention_building = threading.Event()
    prepare_attention = cpu_attention.prepare

    def attention(dtype: torch.dtype) -> bool:
        attention_building.set()
        return prepare_attention(dtype)

    def prepare(model: torch.nn.Module) -> None:
        # Ends only once the attention's build has begun: were the two built one after the other, it never would.
        assert attention_building.wait(timeout=60)
        built_on.append(threading.current_thread().name)

    def prepack(model: torch.nn.Module) -> int:
        packed_after.append(bool(built_on))
        return pack(model)

    pack = packed_linear.prepack_linear_weights
    monkeypatch.setattr(cpu_attention, "prepare", attention)
    monkeypatch.setattr(packed_linear, "prepare", prepare)
    monkeypatch.setattr(packed_linear, "prepack_linear_weights", prepack)
    make_backend(copy.deepcopy(llama), prepack_weights=True)
    assert built_on == ["prefixgate-build"] and packed_after == [True]


@on_packing_cpus
@packed_dtypes
async def test_a_prepacked_backend_serves_and_keeps_its_fingerprint(
    llama: PreTrainedModel, make_backend: BackendFactory, dtype: torch.dtype
) -> None:
    plain = make_backend(as_blocks(copy.deepcopy(llama), dtype))
    packed = make_backend(as_blocks(copy.deepcopy(llama), dtype), prepack_weights=True)
    assert packed.prepacked > 0 and packed.fingerprint == plain.fingerprint
    answer = await collect(packed, make_prompt(30), params=SamplingParams(max_tokens=8, temperature=0.0))
    assert len(answer.token_ids) == 8 or answer.finish_reason == "stop"
