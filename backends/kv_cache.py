"""The transformers KV cache object: build it from blocks, cut blocks out of it, say when it cannot be restored."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from prefixgate.errors import BlockMismatchError

from .backend import KVGeometry

# Layer types (transformers' `layer_types` vocabulary) whose cache holds every past token's K and V.
_PREFIX_LAYER_TYPES = frozenset({"full_attention"})
# Layer types that keep only a window of past tokens; harmless when the window exceeds the whole context.
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


def reuse_refusal(config: PretrainedConfig, context_length: int) -> str | None:
    """Say why this model's cache cannot be restored from prefix blocks, or return None when it can."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or "")
    if "mamba" in model_type or getattr(text, "state_size", None) is not None:
        return (
            f"{model_type or 'this model'} has state-space layers: their recurrent state summarizes the whole "
            "prefix and cannot be rebuilt from per-token KV blocks"
        )
    # The same dispatch transformers uses to pick each layer's cache class, so we judge what will really run.
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    odd = sorted({t for t in layer_types if t not in _PREFIX_LAYER_TYPES | _WINDOW_LAYER_TYPES})
    if odd:
        return (
            f"hybrid layer types {odd} keep state other than per-token K and V (linear attention, shared or "
            "absent KV), so the cache cannot be restored as a plain prefix"
        )
    for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
        window = kwargs.get("sliding_window")
        # A window layer caches only its last `window - 1` tokens; it is a plain prefix only while the window
        # is longer than any sequence the model will see.
        if layer_type in _WINDOW_LAYER_TYPES and (window is None or int(window) <= context_length):
            return (
                f"{layer_type.replace('_', '-')} layers (window {window} tokens, context {context_length}) "
                "drop old tokens from the cache, so it cannot be restored as a plain prefix"
            )
    return None


def check_blocks(blocks: Sequence[torch.Tensor], geometry: KVGeometry) -> None:
    """Raise BlockMismatchError unless every block has the geometry's shape and dtype."""
    for index, block in enumerate(blocks):
        if not isinstance(block, torch.Tensor):
            raise BlockMismatchError(f"cached block {index} is a {type(block).__name__}, not a torch.Tensor")
        if tuple(block.shape) != geometry.block_shape or block.dtype != geometry.dtype:
            raise BlockMismatchError(
                f"cached block {index} has shape {tuple(block.shape)} and dtype {block.dtype}, but this model's "
                f"blocks are {geometry.block_shape} {geometry.dtype} ([layers, 2, kv_heads, block_size, "
                "head_dim]); it was computed under another model, dtype or block size and cannot be used"
            )


def build_cache(blocks: Sequence[torch.Tensor], config: PretrainedConfig, device: torch.device) -> DynamicCache:
    """Build a DynamicCache holding the K and V of `blocks` (block 0 first), on `device`."""
    if not blocks:
        return DynamicCache(config=config)
    kv = _joined_in_place(blocks, device)
    if kv is None:
        kv = torch.cat(
            [b.to(device, non_blocking=True) for b in blocks], dim=3
        )  # kv: [layers, 2, kv_heads, T, head_dim]
    cache = DynamicCache(config=config)
    assert len(cache.layers) == kv.shape[0], "one cache layer per block layer"
    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, DynamicLayer), "only plain KV layers are restored from blocks"
        keys, values = kv[index, 0].unsqueeze(0), kv[index, 1].unsqueeze(0)  # each: [1, kv_heads, T, head_dim]
        if type(layer) is DynamicLayer:
            # Set rather than update(): update() appends to an empty tensor, which copies the whole prefix once
            # more. The first forward pass appends the new tokens by concatenation, so these views stay unwritten.
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        else:
            layer.update(keys, values)  # a subclass (a sliding window) keeps bookkeeping that update() maintains
    return cache


def _joined_in_place(blocks: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """Return the blocks as one tensor without copying when they are consecutive slices of one, else None.

    A store that assembles a prefix in one tensor hands its blocks over as such slices; joining them with cat
    would copy a multi-megabyte prefix a second time on the path to the first token.
    """
    first = blocks[0]
    size = first.shape[3]
    step = first.stride(3) * size  # elements between the starts of two consecutive blocks
    for index, block in enumerate(blocks):
        if (
            block.device != device
            or block.stride() != first.stride()
            or block.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or block.storage_offset() != first.storage_offset() + index * step
        ):
            return None
    shape = (*first.shape[:3], size * len(blocks), first.shape[4])
    return first.as_strided(shape, first.stride())  # kv: [layers, 2, kv_heads, T, head_dim]


def cut_block(cache: DynamicCache, start: int, stop: int) -> torch.Tensor:
    """Copy tokens [start, stop) of every layer out of the cache as one standalone block tensor."""
    layers = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer), "only plain KV layers are cut into blocks"
        keys, values = layer.keys, layer.values  # keys, values: [1, kv_heads, seq, head_dim]
        assert keys is not None and values is not None, "cut_block needs an initialized cache"
        layers.append((keys[0, :, start:stop], values[0, :, start:stop]))  # each: [kv_heads, block, head_dim]
    # Outside inference mode the copy is an ordinary tensor, which a store may later write to in place; an
    # inference tensor would refuse that. stack copies, so the block is never a view into the live cache.
    with torch.inference_mode(False):
        return torch.stack([torch.stack(kv) for kv in layers])  # block: [layers, 2, kv_heads, block, head_dim]


def cache_layout_problem(cache: DynamicCache, geometry: KVGeometry, seq_len: int) -> str | None:
    """Check a cache filled by a real forward pass against the geometry; describe a mismatch or return None."""
    if len(cache.layers) != geometry.layers:
        return f"the cache has {len(cache.layers)} layers but the config says {geometry.layers}"
    expected = (1, geometry.kv_heads, seq_len, geometry.head_dim)
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, DynamicLayer):
            return f"cache layer {index} is a {type(layer).__name__}, not a plain per-token KV layer"
        keys, values = layer.keys, layer.values
        if keys is None or values is None:
            return f"cache layer {index} holds no K/V (shared or absent KV)"
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            return (
                f"cache layer {index} holds K {tuple(keys.shape)} and V {tuple(values.shape)}, "
                f"not [1, kv_heads, seq, head_dim] = {expected}"
            )
        if keys.dtype != geometry.dtype:
            return f"cache layer {index} holds {keys.dtype}, not the model dtype {geometry.dtype}"
    return None
