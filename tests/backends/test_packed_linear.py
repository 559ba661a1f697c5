"""Prepacked linear layers: a bfloat16 model on a CPU computes what it computed before, from oneDNN's own layout."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from prefixgate.backends import HFBackend, SamplingParams
from prefixgate.backends.packed_linear import PackedLinear, applies, prepack_linear_weights
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU or torch build has no oneDNN bfloat16 kernels",
)


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_a_packed_layer_gives_what_the_plain_one_gives(rows: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=True).to(torch.bfloat16)
    x = torch.randn(1, rows, 96, dtype=torch.bfloat16)  # x: [batch, rows, in_features]
    with torch.inference_mode():
        expected = linear(x)
        out = PackedLinear(linear)(x)
    assert out.shape == expected.shape == (1, rows, 160)
    # bfloat16 outputs: at most a unit in the last place apart where the kernels sum in another order.
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)


def test_prepacking_replaces_every_plain_linear_layer_and_keeps_the_logits(llama: PreTrainedModel) -> None:
    model = copy.deepcopy(llama).to(torch.bfloat16)
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


def test_float32_models_and_backends_built_without_it_stay_unpacked(
    llama: PreTrainedModel, make_backend: BackendFactory
) -> None:
    assert not applies(llama) and prepack_linear_weights(llama) == 0
    backend: HFBackend = make_backend(copy.deepcopy(llama).to(torch.bfloat16))
    assert backend.prepacked == 0


async def test_a_prepacked_backend_serves_and_keeps_its_fingerprint(
    llama: PreTrainedModel, make_backend: BackendFactory
) -> None:
    plain = make_backend(copy.deepcopy(llama).to(torch.bfloat16))
    packed = make_backend(copy.deepcopy(llama).to(torch.bfloat16), prepack_weights=True)
    assert packed.prepacked > 0 and packed.fingerprint == plain.fingerprint
    answer = await collect(packed, make_prompt(30), params=SamplingParams(max_tokens=8, temperature=0.0))
    assert len(answer.token_ids) == 8 or answer.finish_reason == "stop"
