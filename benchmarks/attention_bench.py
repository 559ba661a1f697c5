"""A step's attention over a prefix, alone: the C kernel against torch's CPU flash kernel, SmolLM2's shapes.

Run by hand: `.venv/bin/python benchmarks/attention_bench.py` (about half a minute). Random queries of 9 heads attend
over a prefix of 3 KV heads (head size 64) in each of 30 layers, as a step of SmolLM2 does over a shared prefix: N
decoding streams are N queries per head, 16 prompts of 27 tokens are 432. In bfloat16 and in float32, it prints the
median time of the 30 layers for the kernel (`backends/cpu_attention.c`, its output merged into what the step holds,
as a step calls it) and for torch's flash kernel (the prefix in halves, as `attention._attend_prefix` calls it, before
the merge). Where the kernel does not run in a dtype (bfloat16 needs AVX-512 BF16, float32 AVX2; both a compiler),
only torch's column is filled.

With `--from-memory` each timed call comes after a read of 115 MB (SmolLM2's weights as a server holds them on a CPU
with AMX), as a step's linear layers read theirs between its attention calls, so that the prefix comes from memory
rather than from what the last call left in the cache; and a column is added: a sum over the prefix's K and V (torch's,
under the same conditions), which reads each byte once and does little else, the least time a kernel over them could
take on this machine.

The kernel is called from Python here, once a layer with the parts laid out once (`cpu_attention.Plan`), where a step
calls it from C++: a line under the table gives what the same 30 calls take over a 16-token prefix, which bounds what
that adds to each row of the kernel's column.

With `--against DIR` the kernel built from the sources in DIR (`cpu_attention.c` and its two headers, say an earlier
commit's `backends/`) runs beside this one, the two taking turns call by call on the same queries, keys and values, so
that a machine whose speed drifts meets both alike: it adds that column and the median of the call-by-call ratio, and
says whether the two gave the same bits.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from batching_bench import in_turn, table

from prefixgate.backends import cpu_attention
from prefixgate.backends.attention import _attend_prefix

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
CASES = [  # (what the rows are, queries per head, prefix tokens)
    ("1 stream", 1, 4096),
    ("8 streams", 8, 4096),
    ("16 streams", 16, 4096),
    ("16 streams", 16, 7168),
    ("16 prompts of 27 tokens", 432, 4096),
]


WEIGHT_BYTES = 115 * 2**20


def median_ms(run: Callable[[], object], repeats: int, before: Callable[[], object] = lambda: None) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def with_kernels(kernels: cpu_attention.Kernels | None, run: Callable[[], object]) -> Callable[[], object]:
    """`run` with the attention kernel `kernels` (None: this checkout's)."""
    ours = cpu_attention._library

    def swapped() -> object:
        cpu_attention._library = ours if kernels is None else (lambda _dtype: kernels)
        try:
            return run()
        finally:
            cpu_attention._library = ours

    return swapped


def kernel_layers(queries: torch.Tensor, plan: cpu_attention.Plan) -> None:
    out, lse = torch.empty_like(queries), torch.empty(queries.shape[:3])
    for layer in range(LAYERS):
        lse.fill_(float("-inf"))  # nothing held: the kernel writes its own attention
        cpu_attention.attend_parts(queries, plan, layer, HEAD_DIM**-0.5, out, lse)


def one_layer(queries: torch.Tensor, plan: cpu_attention.Plan) -> torch.Tensor:
    """The kernel's output of layer 0 with nothing held, and its log-sum-exp, side by side as bytes."""
    out, lse = torch.empty_like(queries), torch.full(queries.shape[:3], float("-inf"))
    cpu_attention.attend_parts(queries, plan, 0, HEAD_DIM**-0.5, out, lse)
    return torch.cat([out.view(torch.uint8).flatten(), lse.view(torch.uint8).flatten()])


def planned(queries: torch.Tensor, kv: torch.Tensor) -> cpu_attention.Plan:
    """Lay out every query row over all of `kv`'s positions (`[layers, 2, kv_heads, tokens, d]`), once for the layers,
    as a step lays out its parts."""
    return cpu_attention.Plan([cpu_attention.Part(0, queries.shape[2], kv, kv.shape[3])])


def torch_layers(queries: torch.Tensor, kv: torch.Tensor) -> None:
    grouped = queries.reshape(1, KV_HEADS, -1, HEAD_DIM)  # each KV head's queries together, as a step groups them
    for layer in range(LAYERS):
        _attend_prefix(grouped, kv[layer], HEAD_DIM**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from-memory", action="store_true", help="the prefix from memory, and reading it once")
    parser.add_argument("--against", type=Path, metavar="DIR", help="also the kernel built from the sources in DIR")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads\n")
    before = torch.ones(WEIGHT_BYTES // 4).sum if args.from_memory else lambda: None  # reads the weights' bytes
    rows, calls = [], []
    for dtype in (torch.bfloat16, torch.float32):
        kernel = cpu_attention.prepare(dtype)
        dtype_name = str(dtype).removeprefix("torch.")
        against = None
        if kernel and args.against:
            sources = tuple(args.against / source.name for source in cpu_attention._SOURCES)
            against, said = cpu_attention.kernels_from(dtype, sources)
            if against is None:
                raise SystemExit(f"the attention kernel in {args.against}: {said}")
        for name, queries_per_head, tokens in CASES:
            kv = torch.randn(LAYERS, 2, KV_HEADS, tokens, HEAD_DIM).to(dtype)
            queries = torch.randn(1, HEADS, queries_per_head, HEAD_DIM).to(dtype)
            repeats = 3 if queries_per_head > 100 else 9
            theirs = median_ms(functools.partial(torch_layers, queries, kv), repeats, before)
            times = [f"{theirs:.1f} ms"]
            if kernel:
                plan = planned(queries, kv)
                mine = median_ms(functools.partial(kernel_layers, queries, plan), repeats, before)
                times = [f"{mine:.1f} ms", *times, f"{theirs / mine:.1f}x"]
                if against:
                    ways = [with_kernels(k, functools.partial(kernel_layers, queries, plan)) for k in (None, against)]
                    this, other = in_turn(ways, 3 * repeats, before)
                    bits = [with_kernels(k, functools.partial(one_layer, queries, plan))() for k in (None, against)]
                    same = torch.equal(*bits)
                    ratio = statistics.median(t / m for t, m in zip(other, this, strict=True))
                    times += [
                        f"{statistics.median(other) * 1e3:.1f} ms",
                        f"{ratio:.3f}x{'' if same else ', other bits'}",
                    ]
            else:
                times = ["-", *times, "-", *["-", "-"] * bool(args.against)]
            if args.from_memory:
                once = median_ms(kv.view(torch.int64).sum, repeats, before)
                gigabytes = kv.numel() * kv.element_size() / 1e9
                times.append(f"{once:.1f} ms ({gigabytes / once * 1e3:.0f} GB/s)")
            rows.append([dtype_name, name, str(tokens), *times])
        if kernel:  # the same calls over 16 positions: what they cost with next to no prefix
            kv = torch.randn(LAYERS, 2, KV_HEADS, 16, HEAD_DIM).to(dtype)
            queries = torch.randn(1, HEADS, 16, HEAD_DIM).to(dtype)
            floor = median_ms(functools.partial(kernel_layers, queries, planned(queries, kv)), 9, before)
            calls.append(f"{dtype_name}: the kernel's 30 calls over a 16-token prefix take {floor:.1f} ms")
    header = ["dtype", "queries", "prefix", "C kernel", "torch's flash kernel", "speed-up"]
    header += ["the kernel from DIR", "DIR / this build, call by call"] * bool(args.against)
    table(header + ["reading K and V once"] * args.from_memory, rows)
    print("\n".join(calls))


if __name__ == "__main__":
    main()
