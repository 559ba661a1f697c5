"""The transformers KV cache object: build it from blocks, cut blocks out of it, say when it cannot be restored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

from prefixgate.backends.backend import KVGeometry
from prefixgate.errors import BlockMismatchError

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


class AppendLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__
    """A full-attention cache layer that writes new K and V in place, into the spare room of a preallocated buffer.

    transformers' DynamicLayer concatenates on every forward pass, copying the whole cache each step (for SmolLM2 at
    4k tokens, 180 MB a step); this layer writes only the new tokens. `keys` and `values` stay views of the buffer,
    so DynamicLayer's length, mask and crop logic apply unchanged. A full buffer is replaced by one twice as long.
    """

    def __init__(self, storage: torch.Tensor, length: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._storage = storage  # storage: [2, kv_heads, capacity, head_dim]
        keys, values = self._views(length)
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, kv_heads, new, head_dim]
        assert key_states.shape[0] == 1, "prefixgate runs one sequence per cache"
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if end > self._storage.shape[2]:
            two, heads, capacity, head_dim = self._storage.shape
            grown = self._storage.new_empty((two, heads, max(end, 2 * capacity), head_dim))
            grown[:, :, :start] = self._storage[:, :, :start]
            self._storage = grown
        self._storage[0, :, start:end] = key_states[0]
        self._storage[1, :, start:end] = value_states[0]
        self.keys, self.values = self._views(end)
        return self.keys, self.values

    def _views(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._storage[:, :, :length].unsqueeze(1)  # kv: [2, 1, kv_heads, length, head_dim]
        return kv[0], kv[1]


def build_cache(buffer: torch.Tensor, length: int, config: PretrainedConfig) -> DynamicCache:
    """Build a DynamicCache that runs in `buffer`, whose first `length` positions hold the cached prefix's K and V.

    `buffer` is `[layers, 2, kv_heads, capacity, head_dim]` (see KVBuffers); the cache writes into it from then on.
    """
    cache = DynamicCache(config=config)
    assert len(cache.layers) == buffer.shape[0], "one cache layer per buffer layer"
    for index, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[index] = AppendLayer(buffer[index], length)
        elif length:
            assert isinstance(layer, DynamicLayer), "only models with plain KV layers reuse blocks"
            # A window layer (its window longer than any context) keeps bookkeeping that only update() maintains.
            kv = buffer[index, :, :, :length].unsqueeze(1)  # kv: [2, 1, kv_heads, length, head_dim]
            layer.update(kv[0], kv[1])
    return cache


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
