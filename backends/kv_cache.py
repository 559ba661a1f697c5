"""Which KV caches are a plain prefix of per-token K and V blocks, and the checks that say so."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from prefixgate.backends.backend import KVGeometry
from prefixgate.errors import BlockMismatchError

# Layer types (transformers' `layer_types` vocabulary) whose cache holds every past token's K and V.
_PREFIX_LAYER_TYPES = frozenset({"full_attention"})
# Layer types that attend to a window of past tokens only.
_WINDOW_LAYER_TYPES = frozenset({"sliding_attention", "chunked_attention"})


def geometry_from_config(config: PretrainedConfig, dtype: torch.dtype, block_size: int) -> KVGeometry:
    """Return the block geometry a standard decoder with this config would have."""
    text = config.get_text_config(decoder=True)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = getattr(text, "head_dim", None) or (int(text.hidden_size) // heads if heads else 0)
    return KVGeometry(
        layers=int(text.num_hidden_layers),
        kv_heads=kv_heads,
        head_dim=int(head_dim),
        dtype=dtype,
        block_size=block_size,
    )


def reuse_refusal(config: PretrainedConfig) -> str | None:
    """Say why this model's cache cannot be restored from prefix blocks, or return None when it can.

    Sliding-window and chunked layers can: prefixgate keeps every token's K and V for them too and applies the
    window in attention (see `attention.py`), so their blocks are a plain prefix like any other layer's.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or "")
    if "mamba" in model_type or getattr(text, "state_size", None) is not None:
        return (
            f"{model_type or 'this model'} has state-space layers: their recurrent state summarizes the whole "
            "prefix and cannot be rebuilt from per-token KV blocks"
        )
    # The same dispatch transformers uses to pick each layer's cache class, so we judge what will really run.
    layer_types, _ = get_layer_types_and_kwargs(text)
    odd = sorted({t for t in layer_types if t not in _PREFIX_LAYER_TYPES | _WINDOW_LAYER_TYPES})
    if odd:
        return (
            f"hybrid layer types {odd} keep state other than per-token K and V (linear attention, shared or "
            "absent KV), so the cache cannot be restored as a plain prefix"
        )
    return None


def sharing_refusal(config: PretrainedConfig) -> str | None:
    """Say why running requests of this model cannot read a shared prefix in place, or return None when they can.

    Attention over a shared prefix is merged from parts by their log-sum-exp, which holds for full attention without
    logit soft-capping; such models copy the prefix into each request's buffer instead (as every model did before).
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    layer_types, _ = get_layer_types_and_kwargs(text)
    windowed = sorted({t for t in layer_types if t in _WINDOW_LAYER_TYPES})
    if windowed:
        return f"its {' and '.join(windowed)} layers see a window of the prefix, not all of it"
    if getattr(text, "attn_logit_softcapping", None):
        return "its attention soft-caps scores, which do not merge by their log-sum-exp"
    return None


def check_blocks(blocks: Sequence[torch.Tensor], geometry: KVGeometry) -> None:
    """Raise BlockMismatchError unless every block has the geometry's shape and dtype; the last may be partial (fewer
    positions)."""
    for index, block in enumerate(blocks):
        if not isinstance(block, torch.Tensor):
            raise BlockMismatchError(f"cached block {index} is a {type(block).__name__}, not a torch.Tensor")
        shape = list(geometry.block_shape)
        if index == len(blocks) - 1 and block.dim() == len(shape) and 0 < block.shape[3] < shape[3]:
            shape[3] = block.shape[3]  # a partial block: its leading positions only
        if list(block.shape) != shape or block.dtype != geometry.dtype:
            raise BlockMismatchError(
                f"cached block {index} has shape {tuple(block.shape)} and dtype {block.dtype}, but this model's "
                f"blocks are {geometry.block_shape} {geometry.dtype} ([layers, 2, kv_heads, block_size, "
                "head_dim]); it was computed under another model, dtype or block size and cannot be used"
            )
