"""Builders for tiny, offline test models: a byte-level BPE tokenizer and random-weight decoders from configs."""

from __future__ import annotations

from typing import Any

import torch
from gguf import GGMLQuantizationType, quants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "What is the capital of France? Paris is the capital of France.",
    "You are a helpful assistant. Answer briefly and precisely.",
    "naïve café: ünïcödé 日本語 and emoji 🙂 are several bytes each",
]
# The decoder size every tiny test model shares: 2 layers, 4 heads over 2 KV heads of 16, a 512-token context.
TINY_DECODER: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def make_tokenizer(chat_template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer offline; multi-byte characters span several tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def make_llama(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Build a tiny float32 Llama with seeded random weights (2 layers, 4 heads, 2 KV heads of 16)."""
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        **TINY_DECODER,
        "head_dim": 16,
        # Wide initial weights give well-separated logits, so greedy picks are not decided by rounding noise.
        "initializer_range": 0.3,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.eos_token_id,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.eval()  # type: ignore[no-untyped-call]
    return model


def make_mistral(tokenizer: PreTrainedTokenizerFast, *, sliding_window: int, seed: int = 0) -> PreTrainedModel:
    """Build a tiny float32 Mistral with sliding-window attention of `sliding_window` tokens."""
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        **TINY_DECODER,
        head_dim=16,
        sliding_window=sliding_window,
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = MistralForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def as_blocks(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Return the model in `dtype`, its float32 linear weights made exactly GGUF Q8_0 blocks (as a GGUF model's are):
    where MKL serves prompts, only such float32 layers are packed."""
    model = model.to(dtype)
    if dtype == torch.float32:
        with torch.no_grad():
            for layer in model.modules():
                if type(layer) is torch.nn.Linear:
                    blocks = quants.quantize(layer.weight.numpy(), GGMLQuantizationType.Q8_0)
                    layer.weight.copy_(torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q8_0)))
    return model
