"""Blocks from another model's namespace are never used, and models whose cache is no plain prefix are refused."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import Backend, KVGeometry, SamplingParams
from prefixgate.backends.fingerprint import model_fingerprint, tokenizer_hash
from prefixgate.errors import BlockMismatchError
from tests.backends.conftest import BackendFactory
from tests.backends.streams import GREEDY, BlockSink, collect, transformers_greedy
from tests.backends.test_kv_reuse import make_prompt
from tests.backends.tiny_models import make_llama, make_mistral, make_tokenizer


def test_geometry_describes_the_tiny_llama_blocks(make_backend: BackendFactory) -> None:
    backend = make_backend()
    assert backend.geometry == KVGeometry(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32, block_size=8)
    assert backend.geometry.block_shape == (2, 2, 2, 8, 16)
    assert backend.geometry.block_nbytes == 2 * 2 * 2 * 8 * 16 * 4
    assert backend.prefix_reuse and backend.reuse_refusal is None
    assert backend.context_length == 512
    assert isinstance(backend, Backend)


def test_models_with_different_weights_have_different_fingerprints(tokenizer: PreTrainedTokenizerFast) -> None:
    llama = make_llama(tokenizer, seed=0)
    same = make_llama(tokenizer, seed=0)
    other = make_llama(tokenizer, seed=1)
    assert model_fingerprint(same) == model_fingerprint(llama)
    assert model_fingerprint(other) != model_fingerprint(llama)
    nudged = make_llama(tokenizer, seed=0)
    with torch.no_grad():
        nudged.lm_head.weight[0, 0] += 1e-3
    assert model_fingerprint(nudged) != model_fingerprint(llama)


def test_dtype_rope_and_attention_settings_change_the_fingerprint(
    tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel
) -> None:
    base = model_fingerprint(llama)
    bf16 = make_llama(tokenizer).to(torch.bfloat16)  # type: ignore[arg-type]
    assert model_fingerprint(bf16) != base
    scaled = make_llama(tokenizer, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert model_fingerprint(scaled) != base
    eager = make_llama(tokenizer, attn_implementation="eager")
    assert model_fingerprint(eager) != base


def test_tokenizer_hash_covers_vocab_and_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer_hash(make_tokenizer()) == tokenizer_hash(tokenizer)
    assert tokenizer_hash(make_tokenizer(chat_template="{{ messages[0]['content'] }}")) != tokenizer_hash(tokenizer)
    other_vocab = make_tokenizer()
    other_vocab.add_tokens(["<extra>"])
    assert tokenizer_hash(other_vocab) != tokenizer_hash(tokenizer)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 2, 2, 16, 16), torch.float32),  # another block size
        ((3, 2, 2, 8, 16), torch.float32),  # another layer count
        ((2, 2, 4, 8, 8), torch.float32),  # same element count, other heads
        ((2, 2, 2, 8, 16), torch.float16),  # another dtype
    ],
)
def test_a_block_that_does_not_match_the_geometry_is_rejected(
    make_backend: BackendFactory, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    backend = make_backend()
    good = torch.zeros(backend.geometry.block_shape, dtype=backend.geometry.dtype)
    with pytest.raises(BlockMismatchError, match=r"cached block 1 has shape .* cannot be used"):
        backend.generate(make_prompt(30), [good, torch.zeros(shape, dtype=dtype)], GREEDY)


async def test_a_sliding_window_model_reuses_blocks_from_beyond_its_window(
    make_backend: BackendFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    # Every token's K and V stay in the request's buffer and attention applies the window, so blocks that fell out
    # of the window are still the prefix a later request starts from.
    mistral = make_mistral(tokenizer, sliding_window=16)
    backend = make_backend(mistral, prefill_chunk_tokens=8)
    assert backend.prefix_reuse and backend.reuse_refusal is None
    prompt = make_prompt(40)  # longer than the window
    sink = BlockSink()
    expected = transformers_greedy(mistral, prompt, GREEDY.max_tokens)
    assert (await collect(backend, prompt, on_block=sink)).token_ids == expected
    assert (await collect(backend, prompt, sink.blocks[:4])).token_ids == expected


async def test_a_state_space_model_is_refused_for_reuse(
    tokenizer: PreTrainedTokenizerFast, make_backend: BackendFactory
) -> None:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=4)
    mamba = MambaForCausalLM(config)  # HFBackend puts it in eval mode
    backend = make_backend(mamba, context_length=256)
    assert not backend.prefix_reuse
    assert backend.reuse_refusal is not None and "state-space" in backend.reuse_refusal
    sink = BlockSink()
    prompt = make_prompt(40)
    # Served without reuse, prefill in one pass: transformers' state-space layers cannot continue a multi-token step.
    result = await collect(backend, prompt, on_block=sink)
    assert result.token_ids == transformers_greedy(mamba, prompt, GREEDY.max_tokens)
    assert sink.indices == []
    # Its prompt's log probabilities too, from the one pass: those of transformers' own forward
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    chunks = [chunk async for chunk in backend.generate(prompt, [], params)]
    with torch.inference_mode():
        expected = torch.log_softmax(mamba(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [tokens, vocab]
    got = [entry.logprob for entry in chunks[0].prompt_logprobs[1:]]
    assert got == pytest.approx([float(expected[p - 1, prompt[p]]) for p in range(1, len(prompt))], abs=1e-4)
