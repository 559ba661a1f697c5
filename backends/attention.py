"""Packed attention: many requests' new tokens in one forward pass, each attending only to its own KV.

The model runs once over the step's tokens packed into one row (`[1, total, hidden]`): projections, MLPs and norms
see one batch. Attention is the only per-request part. transformers calls this function once per layer with the
packed queries and the new keys and values (RoPE applied); it writes each request's new K and V into that request's
buffer and attends its queries over the buffer's filled positions, as vLLM's attention layer writes to its paged cache
and then attends. No cache object is passed to the model, so transformers neither stores K and V itself nor builds a
mask: this name is not registered for masks, and each request's causal (and sliding-window) mask is built here.
The step reaches the layers through the thread that runs it (`packed_step`), not through the forward's arguments, and
the work is one operator, `prefixgate::attend`: a compiled step (see `ModelRunner.compile`) traces the model around
it and calls it as it is. On an x86 CPU where the C kernel runs (`cpu_attention.py`), the operator is C++
(`cpu_attend.cpp`) and `packed_step` lays the step out for it once, for all its layers; elsewhere, and for what the
kernel does not take, it is `prefixgate::attend_torch`, written here with torch's kernels. Called outside a packed
step (transformers' own `generate` on a model a backend has packed), it attends like SDPA.

A request may start from shared prefixes: KV that several running requests read in place (see `shared_prefix.py`).
Its buffer then holds only what follows them, and its attention is split in parts that merge exactly by their
log-sum-exp (Hydragen, cascade attention): its own positions, attended per request, and each shared prefix, attended
once per step by the queries of every request that reads it, grouped per KV head so that one matrix product serves
them all. Over a 4k-token prefix that is about four times less attention time for 8 decoding requests than one call
each, as every call reads the whole prefix from memory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface

from prefixgate.backends import cpu_attention

NAME = "prefixgate_packed"
_SPLIT_TOKENS = 1024  # shared prefixes at least this long are attended in halves on a CPU (see _attend_prefix)
_GROUPED_CONTEXT = 3072  # a prompt chunk after at least this many positions attends to them grouped (_attend_chunk)
# Past this many runs of shared positions read by the same rows (a prefix the tier stored in pieces), torch's kernels
# attend them copied together each layer, in one call. Measured on SmolLM2 in bfloat16, 2 cores, a step of 8 streams on
# a 4k prefix: 69 ms in one run, 76 in 4 and 97 in 16 attended one by one (a call and a merge each), 71 to 81 ms copied
# together whatever their number (5 to 64). The C kernel merges in place, every run a part of the step's one call
# (`cpu_attention.StepLayout`): compiled steps of 1, 8 and 16 streams on a 4k prefix in 16 runs of 256 took 12.23, 22.78
# and 33.20 ms where a call a run took 14.85, 27.91 and 41.17 (bfloat16, 2 cores of the Zen 4 EPYC, `step_bench.py
# --dtype bfloat16 --prefix 4096 --runs 16 --attention-against DIR`), about a tenth more than in one run.
_MOST_RUNS = 4
_SCORES_BYTES = 64 << 20  # the most float32 scores `_attend_exactly` holds at once, or scores to add `_attend_fused`
# CUDA's memory-efficient attention, which returns the log-sum-exp (see `_attend_fused`)
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
# .batch: the PackedBatch this thread's model runs, inside `packed_step`
_step = threading.local()


@dataclass(frozen=True, slots=True)
class Segment:
    """One request's part of a packed step: its KV buffer, what it holds already, and its new tokens."""

    kv: torch.Tensor  # kv: [layers, 2, kv_heads, capacity, head_dim]; position p at index p - offset
    start: int  # positions filled already; the new tokens take positions [start, start + length)
    length: int
    offset: int = 0  # positions [0, offset) are not in `kv` but in `shared`
    # The shared prefixes the request starts from, root first, together covering positions [0, offset): runs of
    # positions, each [layers, 2, kv_heads, tokens, head_dim], the same tensor object for every request that reads it.
    shared: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedReaders:
    """Shared positions of a step that the same packed rows read (runs of one prefix, or of nested prefixes with the
    same readers), and those rows."""

    kv: tuple[torch.Tensor, ...]  # runs of positions, in order: each [layers, 2, kv_heads, tokens, head_dim]
    rows: torch.Tensor | slice  # rows: [readers' tokens] into the packed step, a slice when they are contiguous


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """The segments of one step, in packing order; `cu_seqlens[i]` is where segment i's tokens start."""

    segments: tuple[Segment, ...]
    cu_seqlens: tuple[int, ...]  # [segments + 1]: 0, len_0, len_0 + len_1, ..., total
    shared: tuple[SharedReaders, ...] = ()  # each run of shared positions once, parents before children
    # The shared runs lie in the C kernel's order (`cpu_attention.KernelOrder`), lent by a tier laid out in it: only
    # the kernel reads them then.
    shared_tiled: bool = False

    @classmethod
    def of(
        cls, segments: tuple[Segment, ...], device: torch.device | None = None, *, shared_tiled: bool = False
    ) -> PackedBatch:
        """Pack segments in the order given, grouping their rows by the shared prefixes they read."""
        bounds = [0]
        readers: dict[int, tuple[torch.Tensor, list[int]]] = {}  # by the prefix tensor's identity
        for segment in segments:
            for kv in segment.shared:
                readers.setdefault(id(kv), (kv, []))[1].extend(range(bounds[-1], bounds[-1] + segment.length))
            bounds.append(bounds[-1] + segment.length)
        # A parent comes before its children (dicts keep insertion order, and every reader lists parents first); runs
        # one after another with the same readers go together.
        groups: list[tuple[list[torch.Tensor], list[int]]] = []
        for kv, rows in readers.values():
            if groups and groups[-1][1] == rows:
                groups[-1][0].append(kv)
            else:
                groups.append(([kv], rows))
        shared = tuple(SharedReaders(tuple(runs), _rows(rows, device)) for runs, rows in groups)
        return cls(segments, tuple(bounds), shared, shared_tiled and bool(shared))


@contextmanager
def packed_step(batch: PackedBatch) -> Iterator[None]:
    """Run the model's attention as this packed step, on this thread, inside the block."""
    layout = _kernel_layout(batch) if cpu_attention.takes(batch.segments[0].kv) else None
    if batch.shared_tiled and layout is None:
        raise RuntimeError("shared prefixes in the C kernel's order, where the kernel does not attend this step")
    _step.batch = batch
    if layout is not None:
        cpu_attention.set_step(layout)
    try:
        yield
    finally:
        _step.batch = None
        if layout is not None:
            cpu_attention.set_step(None)


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
    """Attend as the packed step this thread runs (`packed_step`), or like SDPA outside one; return `[1, total,
    heads, head_dim]`. The work is the `prefixgate::attend` operator, which a compiled step calls as it is."""
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    layer = int(getattr(module, "layer_idx", -1))  # every attention module of transformers has one; used in a step
    window = None if sliding_window is None else int(sliding_window)
    return torch.ops.prefixgate.attend(query, key, value, layer, float(scale), window, softcap or None), None


# A plain operator, as `prefixgate::packed_linear` is: `torch.library.custom_op`'s wrapper cost about 7 µs more a call
# (74 against 81 µs for one decoding request's layer, the two called in turn), and checks nothing this one needs.
_OPS = torch.library.Library("prefixgate", "FRAGMENT")  # type: ignore[no-untyped-call]
for _name in ("attend", "attend_torch"):
    _OPS.define(  # type: ignore[no-untyped-call]
        f"{_name}(Tensor query, Tensor key, Tensor value, int layer, float scale, int? sliding_window,"
        " float? softcap) -> Tensor"
    )


def _attend_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Write each segment's new K and V into its buffer and attend its queries over it and its shared prefixes.

    The buffers written are the step's, not arguments: a compiled step sees an operator that returns its output.
    """
    heads = query.shape[1]
    batch: PackedBatch | None = getattr(_step, "batch", None)
    if batch is None:
        # The model called outside a packed step (transformers' own generate, say), with transformers' cache: each
        # row one unpadded sequence whose queries are the last of its keys.
        start = key.shape[2] - query.shape[2]
        mask = _mask(start, query.shape[2], 0, key.shape[2], sliding_window, query.device)
        return _attend(query, key, value, mask, scale, softcap).transpose(1, 2).contiguous()
    if batch.shared and (sliding_window is not None or softcap):
        raise RuntimeError("shared prefixes need full attention without soft-capping; run such models unshared")
    # query: [1, heads, total, head_dim]; key, value: [1, kv_heads, total, head_dim]
    new = torch.stack((key[0], value[0]))  # new: [2, kv_heads, total, head_dim]
    outputs, lses = [], []
    # One pass per segment, kept to a few tensor operations: at 32 decoding streams this loop runs ~1,000 times a step.
    for segment, begin in zip(batch.segments, batch.cu_seqlens, strict=False):
        # Indices into the segment's own buffer, which starts at position `offset`.
        start, end = segment.start - segment.offset, segment.start - segment.offset + segment.length
        stored = segment.kv[layer]  # stored: [2, kv_heads, capacity, head_dim]
        stored[:, :, start:end] = new[:, :, begin : begin + segment.length]
        # Keys a query may see: none past its own position, none at or before `position - window`.
        low = 0 if sliding_window is None else max(0, start - int(sliding_window) + 1)
        queries = query[:, :, begin : begin + segment.length]
        if (
            segment.length > 1
            and start - low >= _GROUPED_CONTEXT
            and sliding_window is None
            and not softcap
            and query.device.type == "cpu"  # the grouping was measured against a CPU's kernels only
        ):
            out, lse = _attend_chunk(queries, stored[:, :, low:start], stored[:, :, start:end], start, scale)
        else:
            # SDPA's CPU kernels take 4-d inputs; 3-d ones fall back to a path several times slower.
            seen = stored[:, :, low:end].unsqueeze(1)  # seen: [2, 1, kv_heads, seen, head_dim]
            mask = _mask(start, segment.length, low, end, sliding_window, query.device)
            if batch.shared:
                out, lse = attend_with_lse(queries, seen[0], seen[1], mask, scale)
            else:
                out, lse = _attend(queries, seen[0], seen[1], mask, scale, softcap), None
        if batch.shared:
            assert lse is not None
            lses.append(lse)
        outputs.append(out)
    out = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]  # out: [1, heads, total, head_dim]
    assert out.shape[1] == heads
    if batch.shared:
        lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]  # lse: [1, heads, total], float32
        out = _add_shared(query, out, lse, batch.shared, layer, scale)
    return out.transpose(1, 2).contiguous()  # [1, total, heads, head_dim]


def _kernel_layout(batch: PackedBatch) -> cpu_attention.StepLayout:
    """Lay the step out for the C kernel, once for all its layers (see `cpu_attention.StepLayout`)."""
    parts = []
    for segment, begin in zip(batch.segments, batch.cu_seqlens, strict=False):
        start = segment.start - segment.offset  # in the segment's own buffer
        parts.append(cpu_attention.Part(begin, segment.length, segment.kv, start + segment.length, start))
    readers = []
    for shared in batch.shared:
        rows = shared.rows
        first, count = (rows.start, rows.stop - rows.start) if isinstance(rows, slice) else (0, len(rows))
        # A part a run, each merging into the rows what the one before left (see `cpu_attention.StepLayout`).
        runs = [cpu_attention.Part(first, count, run, run.shape[3], None, batch.shared_tiled) for run in shared.kv]
        readers.append(cpu_attention.Readers(cpu_attention.Plan(runs), None if isinstance(rows, slice) else rows))
    return cpu_attention.StepLayout(cpu_attention.Plan(parts), readers)


# Where `prefixgate::attend` in C++ is loaded (cpu_attend.cpp) it is the CPU's; it attends with the kernel the step laid
# out and calls `attend_torch` for every other step. Elsewhere both are this one, with torch's kernels.
for _name in ("attend", "attend_torch"):
    _OPS.impl(_name, _attend_step, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]

    @torch.library.register_fake(f"prefixgate::{_name}")  # type: ignore[untyped-decorator]
    def _(query: torch.Tensor, *rest: object) -> torch.Tensor:
        return query.new_empty((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))


def attend_with_lse(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend queries `[1, heads, q, d]` over keys and values `[1, kv_heads, k, d]`; return the output and each
    query's log-sum-exp of its scores (`[1, heads, q]`, float32), which merge partial attentions exactly."""
    if queries.device.type == "cpu":
        # The CPU flash kernel returns the log-sum-exp beside the output, at SDPA's speed, and groups heads itself.
        additive = None if mask is None else _additive(mask, queries.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            queries, keys, values, 0.0, False, attn_mask=additive, scale=scale
        )
        return out, lse.float()
    if queries.device.type == "cuda":
        return _attend_fused(queries, keys, values, mask, scale)
    return _attend_exactly(queries, keys, values, mask, scale)


def _attend_fused(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend as `attend_with_lse` does, on CUDA: one launch of torch's memory-efficient kernel, which returns the
    log-sum-exp, where `_attend_exactly` makes about a dozen. A step runs this once a layer for each request that reads
    a shared prefix, and on a GPU a step's time is its launches (benchmarks/launch_bench.py).

    Query heads are grouped by the KV head they read, as `_attend_exactly` groups them, so the kernel sees as many
    heads in the queries as in the keys; a mask becomes scores to add, its rows repeated for each group, made for a
    slice of the queries at a time, at most `_SCORES_BYTES` as `_attend_exactly`'s scores are.
    """
    _, heads, count, head_dim = queries.shape
    kv_heads, seen = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    stride = -(-seen // 16) * 16  # the kernel reads the bias in rows a multiple of 16 elements apart
    step = count if mask is None else max(1, _SCORES_BYTES // (groups * stride * queries.element_size()))
    outputs, lses = [], []
    for first in range(0, count, step):
        part = queries[:, :, first : first + step]
        length = part.shape[2]
        rows = groups * length
        bias = None
        if mask is not None:
            bias = torch.zeros((rows, stride), dtype=queries.dtype, device=queries.device)[:, :seen]
            bias.masked_fill_(~mask[first : first + length].repeat(groups, 1), float("-inf"))
            bias = bias.expand(1, kv_heads, rows, seen)
        grouped = part.reshape(1, kv_heads, rows, head_dim)
        out, lse, _, _ = _EFFICIENT(grouped, keys, values, bias, True, scale=scale)  # lse: rows rounded up to 32
        outputs.append(out.reshape(1, heads, length, head_dim))
        lses.append(lse[:, :, :rows].reshape(1, heads, length))
    if len(outputs) == 1:
        return outputs[0], lses[0]
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)


def _attend_exactly(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend as `attend_with_lse` does, in plain matrix products: on any device (used where no fused kernel
    returning the log-sum-exp is called, and as the reference the tests hold the kernels to).

    Query heads are grouped by the KV head they read, as rows of one matrix per KV head, so K and V are never copied
    per query head; and the float32 scores are made for a slice of the queries at a time, at most `_SCORES_BYTES`, so a
    long prompt chunk over a long context (2,048 grouped rows over 32k keys would be 2 GiB a KV head) stays bounded.
    """
    _, heads, count, head_dim = queries.shape
    kv_heads, seen = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    keys, values = keys.float(), values.float()  # keys, values: [1, kv_heads, seen, d]
    step = max(1, _SCORES_BYTES // (heads * seen * 4))
    outputs, lses = [], []
    for first in range(0, count, step):
        part = queries[:, :, first : first + step]
        length = part.shape[2]
        # Row g * length + i of KV head h is query i of head h * groups + g.
        grouped = part.float().reshape(1, kv_heads, groups * length, head_dim)
        scores = torch.matmul(grouped, keys.transpose(-2, -1)) * scale  # scores: [1, kv_heads, rows, seen]
        if mask is not None:
            scores = scores.masked_fill(~mask[first : first + length].repeat(groups, 1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # lse: [1, kv_heads, rows]
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), values)
        outputs.append(out.reshape(1, heads, length, head_dim))
        lses.append(lse.reshape(1, heads, length))
    return torch.cat(outputs, dim=2).to(queries.dtype), torch.cat(lses, dim=2)


def _attend_chunk(
    queries: torch.Tensor, context: torch.Tensor, own: torch.Tensor, start: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend a prompt chunk's queries `[1, heads, length, d]` over the positions before it (`context`,
    `[2, kv_heads, positions, d]`, all visible to every query) and its own (`own`, `[2, kv_heads, length, d]`,
    causally); return the output and log-sum-exp.

    Over the context no mask is needed, so every query head reading one KV head becomes a row of one matrix per KV
    head, as over a shared prefix: the kernel reads each key once for all of them instead of once per query head.
    Measured on SmolLM2 and a CPU in bfloat16, for chunks of 32 to 512 tokens: a step's attention took 13 to 35% less
    after 8k positions and 1 to 20% less after 4k, but up to 18% more after 1k, hence `_GROUPED_CONTEXT`.
    """
    _, heads, length, head_dim = queries.shape
    kv_heads = context.shape[1]
    grouped = queries.reshape(1, kv_heads, heads // kv_heads * length, head_dim)
    parts, part_lses = _attend_prefix(grouped, context, scale)
    mask = _mask(start, length, start, start + length, None, queries.device)
    out, lse = attend_with_lse(queries, own[0:1], own[1:2], mask, scale)
    outs = torch.cat((out, parts.reshape(-1, heads, length, head_dim)))
    return _merge(outs, torch.cat((lse, part_lses.reshape(-1, heads, length))))


def _add_shared(
    query: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    shared: tuple[SharedReaders, ...],
    layer: int,
    scale: float,
) -> torch.Tensor:
    """Attend each run of shared positions once for all its readers' queries and merge it into their outputs."""
    _, heads, _, head_dim = query.shape
    for readers in shared:
        runs = _runs(readers, layer)
        kv_heads = runs[0].shape[1]
        rows = readers.rows
        picked = query[:, :, rows]  # picked: [1, heads, rows, head_dim]
        count = picked.shape[2]
        # Query heads are grouped by the KV head they read (head h reads KV head h // groups): as rows of one matrix
        # per KV head, every reader's queries meet each shared key once.
        grouped = picked.reshape(1, kv_heads, heads // kv_heads * count, head_dim)
        outs, lses = [out[:, :, rows]], [lse[:, :, rows]]
        for kv in runs:
            parts, part_lses = _attend_prefix(grouped, kv, scale)
            outs.append(parts.reshape(-1, heads, count, head_dim))
            lses.append(part_lses.reshape(-1, heads, count))
        # Every part at once: each a few tensor operations on all parts instead of a dozen per pair.
        merged, merged_lse = _merge(torch.cat(outs), torch.cat(lses))
        out[:, :, rows] = merged
        lse[:, :, rows] = merged_lse
    return out


def _runs(readers: SharedReaders, layer: int) -> list[torch.Tensor]:
    """Return one layer of the runs of shared positions the readers read, each `[2, kv_heads, tokens, head_dim]`."""
    runs = [kv[layer] for kv in readers.kv]
    if len(runs) > _MOST_RUNS:  # a prefix stored in many pieces: one copy beats a call and a merge per piece
        runs = [torch.cat(runs, dim=2)]
    return runs


def _attend_prefix(grouped: torch.Tensor, kv: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend grouped queries `[1, kv_heads, rows, d]` over one layer of a shared prefix `[2, kv_heads, tokens, d]`;
    return the attention over each part of it, `[parts, kv_heads, rows, d]`, and each part's log-sum-exp, `[parts,
    kv_heads, rows]`, for `_merge`.

    On a CPU a long prefix is cut in halves, attended as one batched call: the kernel shares its work out by KV head
    and block of queries, and with few of both (SmolLM2: 3 KV heads, 24 rows for 8 streams) one of two cores does
    twice the other's share. Measured on SmolLM2 and 2 cores: a step of 8 streams on a 7k-token prefix takes 105 ms
    instead of 115 (no change at 4k tokens; quarters gave nothing more).
    """
    keys, values = kv[0], kv[1]  # keys, values: [kv_heads, tokens, d]
    kv_heads, tokens, head_dim = keys.shape
    if grouped.device.type != "cpu" or tokens < _SPLIT_TOKENS or tokens % 2:
        return attend_with_lse(grouped, keys.unsqueeze(0), values.unsqueeze(0), None, scale)
    key_halves = keys.reshape(kv_heads, 2, tokens // 2, head_dim).transpose(0, 1)  # [2, kv_heads, tokens / 2, d]
    value_halves = values.reshape(kv_heads, 2, tokens // 2, head_dim).transpose(0, 1)
    return attend_with_lse(grouped.expand(2, -1, -1, -1), key_halves, value_halves, None, scale)


def _merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the attention over disjoint sets of keys, `[1, ...]`, from each one's output `[sets, ...]` and
    log-sum-exp `[sets, ...]` (the output's shape without its last dimension)."""
    total = torch.logsumexp(lses, dim=0, keepdim=True)  # total: [1, ...]
    weights = torch.exp(lses - total).unsqueeze(-1)  # float32, so the weighted sum is too
    return (outs * weights).sum(dim=0, keepdim=True).to(outs.dtype), total


def _rows(rows: list[int], device: torch.device | None) -> torch.Tensor | slice:
    if rows[-1] - rows[0] == len(rows) - 1:  # increasing, so contiguous: a view instead of a gather and scatter
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.long, device=device)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Return a boolean mask as scores to add: 0 where a key is seen, minus infinity where it is not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


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
