"""The decoder families people serve locally run packed steps and reuse cached blocks, token for token with
transformers' own `generate`: Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3, each a tiny random model.

Sliding-window layers (Mistral, Qwen2's mixed layers, Gemma 2 and 3) and Gemma 2's logit soft-capping are where a
packed step differs most from a plain forward pass, so each window is shorter than the prompts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import SamplingParams
from prefixgate.backends.model_runner import ModelRunner, StepInput
from tests.backends.conftest import BackendFactory
from tests.backends.streams import BlockSink, collect, transformers_attention, transformers_greedy
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.tiny_models import TINY_DECODER

ANSWER = SamplingParams(max_tokens=10, temperature=0.0)
WINDOW = 12  # tokens; every prompt below is longer


def _model(config_class: type, model_class: type, **settings: Any) -> Callable[[int], PreTrainedModel]:
    def build(vocab_size: int) -> PreTrainedModel:
        torch.manual_seed(0)
        options = {"vocab_size": vocab_size, **TINY_DECODER, "head_dim": 16, "initializer_range": 0.3}
        model = model_class(config_class(**(options | settings)))
        model.eval()
        return model  # type: ignore[no-any-return]

    return build


def _families() -> dict[str, Callable[[int], PreTrainedModel]]:
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    mixed = ["sliding_attention", "full_attention"]
    return {
        "llama": _model(LlamaConfig, LlamaForCausalLM),
        "qwen2-mixed-window": _model(
            Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=WINDOW, layer_types=mixed
        ),
        "qwen3": _model(Qwen3Config, Qwen3ForCausalLM),
        "mistral-window": _model(MistralConfig, MistralForCausalLM, sliding_window=WINDOW),
        "phi3": _model(Phi3Config, Phi3ForCausalLM, pad_token_id=0),
        "gemma2-softcap-window": _model(
            Gemma2Config,
            Gemma2ForCausalLM,
            sliding_window=WINDOW,
            layer_types=mixed,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=10.0,
            query_pre_attn_scalar=16,
        ),
        "gemma3-window": _model(
            Gemma3TextConfig, Gemma3ForCausalLM, sliding_window=WINDOW, layer_types=mixed, query_pre_attn_scalar=16
        ),
    }


FAMILIES = _families()


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_family_matches_transformers_alone_from_cached_blocks_and_in_a_batch(
    family: str, make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = FAMILIES[family](len(tokenizer))
    prompts = [make_prompt(length, offset) for length, offset in ((40, 3), (29, 8), (51, 13))]
    expected = [transformers_greedy(model, prompt, ANSWER.max_tokens) for prompt in prompts]
    backend = make_backend(model, prefill_chunk_tokens=16, interleaved_prefill_tokens=5)
    assert backend.prefix_reuse, backend.reuse_refusal
    sink = BlockSink()
    alone = await collect(backend, prompts[0], params=ANSWER, on_block=sink)
    assert alone.token_ids[: len(expected[0])] == expected[0][: len(alone.token_ids)]
    assert len(alone.token_ids) == ANSWER.max_tokens or alone.finish_reason == "stop"
    # From 3 cached blocks (24 tokens, twice the window), and beside two other requests in the same steps.
    together = await asyncio.gather(
        collect(backend, prompts[0], sink.blocks[:3], params=ANSWER),
        collect(backend, prompts[1], params=ANSWER),
        collect(backend, prompts[2], params=ANSWER),
    )
    for result, tokens in zip(together, expected, strict=True):
        assert result.token_ids == tokens[: len(result.token_ids)]
    assert together[0].token_ids == alone.token_ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_a_family_gives_transformers_logits_chunk_by_chunk_beside_another_request(
    family: str, make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = FAMILIES[family](len(tokenizer))
    prompt, other = make_prompt(40), make_prompt(20, offset=9)
    with torch.inference_mode(), transformers_attention(model):
        expected = model(torch.tensor([prompt])).logits[0].float()  # expected: [40, vocab]
        expected_other = model(torch.tensor([other])).logits[0].float()
    geometry = make_backend(model).geometry  # the backend packs the model's attention
    runner = ModelRunner(model)
    shape = (geometry.layers, 2, geometry.kv_heads, 64, geometry.head_dim)
    buffer, other_buffer = torch.zeros(shape), torch.zeros(shape)
    with torch.inference_mode():
        # Chunks that end inside and past the window, each in a step with a chunk of another request.
        for (begin, end), (other_begin, other_end) in zip(
            ((0, 16), (16, 30), (30, 40)), ((0, 7), (7, 8), (8, 20)), strict=True
        ):
            logits = runner.run(
                [
                    StepInput(prompt[begin:end], buffer, begin),
                    StepInput(other[other_begin:other_end], other_buffer, other_begin),
                ]
            )
            torch.testing.assert_close(logits[0], expected[end - 1], atol=1e-4, rtol=0)
            torch.testing.assert_close(logits[1], expected_other[other_end - 1], atol=1e-4, rtol=0)
