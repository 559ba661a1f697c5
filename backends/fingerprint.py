"""Fingerprints: digests of everything that changes a model's KV values, and of its tokenizer and chat template.

KV blocks are only ever shared between requests whose namespace (built from these digests) is equal, so anything
that could change a cached K or V, or the token ids a prompt renders to, must go into one of them.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import transformers
import xxhash
from transformers import PreTrainedModel, PreTrainedTokenizerBase

# Bump when what goes into a digest changes, so digests from older code never compare equal.
_MODEL_SCHEME = b"prefixgate-model-fingerprint-v1"
_TOKENIZER_SCHEME = b"prefixgate-tokenizer-hash-v1"
# Config entries that name where or by which release a model was saved, not what it computes. `architectures` is
# filled in by save_pretrained; the class that actually runs is hashed instead.
_CONFIG_NOISE = frozenset(
    {"_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype", "architectures"}
)


def model_fingerprint(model: PreTrainedModel) -> str:
    """Hash the weights' bytes, the config, dtype, attention implementation and RoPE settings of a model."""
    digest = xxhash.xxh3_128(_MODEL_SCHEME)
    config = model.config
    config_dict = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    text = config.get_text_config(decoder=True)
    settings = {
        "class": type(model).__name__,
        "config": config_dict,
        "dtype": str(model.dtype),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "rope_parameters": getattr(text, "rope_parameters", None),
        "rope_scaling": getattr(text, "rope_scaling", None),
        "rope_theta": getattr(text, "rope_theta", None),
        # Model code (RoPE, norms, attention) can change between releases; a new release starts a new namespace
        # rather than risk serving KV that the running code would compute differently.
        "transformers": transformers.__version__,
    }
    digest.update(_canonical_json(settings))
    # Parameters and buffers: buffers include RoPE's inv_freq, which transformers does not save in state_dict.
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name in sorted(tensors):
        _update_with_tensor(digest, name, tensors[name])
    return digest.hexdigest()


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash a tokenizer's vocabulary, merges, normalization, special tokens and chat template."""
    digest = xxhash.xxh3_128(_TOKENIZER_SCHEME)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The serialized `tokenizers` pipeline: vocab, merges, normalizer, pre-tokenizer, added tokens.
        digest.update(backend.to_str().encode())
    else:
        digest.update(_canonical_json(sorted(tokenizer.get_vocab().items())))
    template = tokenizer.chat_template
    settings = {
        "class": type(tokenizer).__name__,
        "special_tokens": tokenizer.special_tokens_map,
        "chat_template": template if isinstance(template, (str, dict)) else None,
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
        "add_eos_token": getattr(tokenizer, "add_eos_token", None),
    }
    digest.update(_canonical_json(settings))
    return digest.hexdigest()


def _update_with_tensor(digest: xxhash.xxh3_128, name: str, tensor: torch.Tensor) -> None:
    header = f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode()
    digest.update(len(header).to_bytes(8, "little") + header)
    # Streaming one tensor at a time keeps at most one tensor's bytes on the host, even for a GPU model.
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # flat: [numel]
    digest.update(flat.view(torch.uint8).numpy().data)


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":")).encode()
