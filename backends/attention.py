"""Packed attention: many requests' new tokens in one forward pass, each attending only to its own KV buffer.

The model runs once over the step's tokens packed into one row (`[1, total, hidden]`): projections, MLPs and norms
see one batch. Attention is the only per-request part. transformers calls this function once per layer with the
packed queries and the new keys and values (RoPE applied); it writes each request's new K and V into that request's
buffer and attends its queries over the buffer's filled positions, as vLLM's attention layer writes to its paged cache
and then attends. No cache object is passed to the model, so transformers neither stores K and V itself nor builds a
mask: this name is not registered for masks, and each request's causal (and sliding-window) mask is built here.
Called outside a packed step (transformers' own `generate` on a model a backend has packed), it attends like SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

NAME = "prefixgate_packed"
BATCH_ARGUMENT = "packed_batch"  # the forward keyword that carries the PackedBatch down to every attention layer


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's part of a packed step: its KV buffer, what it holds already, and its new tokens."""

    kv: torch.Tensor  # kv: [layers, 2, kv_heads, capacity, head_dim]
    start: int  # positions of `kv` already filled; the new tokens take positions [start, start + length)
    length: int


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """The segments of one step, in packing order; `cu_seqlens[i]` is where segment i's tokens start."""

    segments: tuple[Segment, ...]
    cu_seqlens: tuple[int, ...]  # [segments + 1]: 0, len_0, len_0 + len_1, ..., total

    @classmethod
    def of(cls, segments: tuple[Segment, ...]) -> PackedBatch:
        """Pack segments in the order given."""
        bounds = [0]
        for segment in segments:
            bounds.append(bounds[-1] + segment.length)
        return cls(segments, tuple(bounds))


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write each segment's new K and V into its buffer and attend its queries over that buffer."""
    heads, head_dim = query.shape[1], query.shape[3]
    scale = scaling if scaling is not None else head_dim**-0.5
    batch = kwargs.get(BATCH_ARGUMENT)
    if batch is None:
        # The model called outside a packed step (transformers' own generate, say), with transformers' cache: each
        # row one unpadded sequence whose queries are the last of its keys.
        start = key.shape[2] - query.shape[2]
        mask = _mask(start, query.shape[2], 0, key.shape[2], sliding_window, query.device)
        return _attend(query, key, value, mask, scale, softcap).transpose(1, 2).contiguous(), None
    assert isinstance(batch, PackedBatch)
    layer = int(getattr(module, "layer_idx"))  # noqa: B009  # every attention module of transformers has one
    # query: [1, heads, total, head_dim]; key, value: [1, kv_heads, total, head_dim]
    new = torch.stack((key[0], value[0]))  # new: [2, kv_heads, total, head_dim]
    outputs = []
    # One pass per segment, kept to a few tensor operations: at 32 decoding streams this loop runs ~1,000 times a step.
    for segment, begin in zip(batch.segments, batch.cu_seqlens, strict=False):
        start, end = segment.start, segment.start + segment.length
        stored = segment.kv[layer]  # stored: [2, kv_heads, capacity, head_dim]
        stored[:, :, start:end] = new[:, :, begin : begin + segment.length]
        # Keys a query may see: none past its own position, none at or before `position - window`.
        low = 0 if sliding_window is None else max(0, start - int(sliding_window) + 1)
        # SDPA's CPU kernels take 4-d inputs; 3-d ones fall back to a path several times slower.
        seen = stored[:, :, low:end].unsqueeze(1)  # seen: [2, 1, kv_heads, seen, head_dim]
        mask = _mask(start, segment.length, low, end, sliding_window, query.device)
        outputs.append(_attend(query[:, :, begin : begin + segment.length], seen[0], seen[1], mask, scale, softcap))
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]  # out: [1, heads, total, head_dim]
    assert out.shape[1] == heads
    return out.transpose(1, 2).contiguous(), None  # [1, total, heads, head_dim]


def _mask(start: int, length: int, low: int, end: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Return which keys `[low, end)` each new query `[start, start + length)` sees, or None when it sees them all."""
    if length == 1 and (window is None or end - low <= window):
        return None  # one new token sees every stored position up to itself, and `low` already cut the window
    positions = torch.arange(start, end, device=device).unsqueeze(1)  # positions: [length, 1]
    keys = torch.arange(low, end, device=device).unsqueeze(0)  # keys: [1, seen]
    visible = keys <= positions
    if window is not None:
        visible &= keys > positions - window
    return visible  # visible: [length, seen]


def _attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attend queries `[..., heads, q, d]` over keys and values `[..., kv_heads, k, d]`; return `[..., heads, q, d]`."""
    groups = queries.shape[-3] // keys.shape[-3]
    if not softcap:
        # SDPA expands grouped K and V itself (enable_gqa), which on a CPU saves the copy a repeat would make.
        return torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=groups > 1
        )
    # Logit soft-capping (Gemma 2) has no SDPA kernel: the eager computation, as transformers' own eager path does.
    keys = keys.repeat_interleave(groups, dim=-3)
    values = values.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(queries, keys.transpose(-2, -1)) * scale  # scores: [..., heads, q, k]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(weights, values)


AttentionInterface.register(NAME, packed_attention)
