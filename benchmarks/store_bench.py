"""Measure the block store: key hashing, host-tier put/get and LMDB get, each beside its plain baseline, the
pieces a shared prefix lies in under churn, and looking up a prefix that many prompts' tails follow.

Run by hand: `.venv/bin/python benchmarks/store_bench.py`. Blocks have SmolLM2-135M's geometry in float32
(30 layers, 3 KV heads, head_dim 64, 64 tokens a block: 2.8 MiB each). The churn measure runs a full host tier of 400
small blocks: requests on 30 prefixes of 40 blocks (a few of them hot), each storing its prefix if it was evicted and
2 blocks of its own; every tenth request, once the tier is warm, its prefix is lent (`TieredStore.borrow`, as a shared
prefix is) and given back. It prints the pieces (runs of consecutive slots) the prefix lay in before the loan and when
lent. The last rows time a look up and a fetch of a prompt on a prefix that 10, 1,000 and 10,000 tails follow.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from prefixgate.policies import make_policy
from prefixgate.store import (
    Block,
    BlockLayout,
    Namespace,
    StoreConfig,
    TierConfig,
    TieredStore,
    chain_keys,
    tail_key,
)
from prefixgate.store.lmdb_tier import LMDBTier
from prefixgate.store.memory_tier import MemoryTier

LAYOUT = BlockLayout(shape=(30, 2, 3, 64, 64), dtype=torch.float32)
NAMESPACE = Namespace("bench-model", "bench-tokenizer", "float32", LAYOUT.shape)
SEED = NAMESPACE.seed(bytes(32))


def best_of(repeats: int, run: Callable[[], object]) -> float:
    """Return the median wall time of `run` in seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_blocks(count: int) -> list[Block]:
    tokens = list(range(count * LAYOUT.block_size))
    keys = chain_keys(SEED, tokens, LAYOUT.block_size)
    size = LAYOUT.block_size
    return [
        Block(key, tuple(tokens[i * size : (i + 1) * size]), torch.randn(LAYOUT.shape), created=1.0)
        for i, key in enumerate(keys)
    ]


def bench_hashing(rows: list[tuple[str, str, str, str]]) -> None:
    for length in (1024, 8192, 32768):
        tokens = list(range(length))
        seconds = best_of(50, lambda tokens=tokens: chain_keys(SEED, tokens, LAYOUT.block_size))  # type: ignore[misc]
        rows.append((f"hash keys, {length // 1024}k tokens", f"{seconds * 1e3:.3f} ms", "target < 2 ms", ""))


def bench_host(rows: list[tuple[str, str, str, str]], count: int) -> None:
    blocks = make_blocks(count)
    total = count * LAYOUT.nbytes
    clock = time.monotonic
    tier = MemoryTier("host", LAYOUT, total, make_policy("lru", clock=clock), clock=clock)
    destination = torch.empty((count, *LAYOUT.shape))  # the same bytes, copied plainly

    def put_all() -> None:
        for block in blocks:
            tier.put(block)

    def copy_all() -> None:
        for index, block in enumerate(blocks):
            destination[index].copy_(block.kv)

    def get_all() -> None:
        for block in blocks:
            tier.get(block.key, block.tokens)

    def clone_all() -> None:
        for index in range(count):
            destination[index].clone()

    put_all()  # touch every page of the pool once, as a running server would have
    copy_all()
    for name, run, baseline_name, baseline in (
        ("host tier put", put_all, "plain copy_", copy_all),
        ("host tier get", get_all, "plain clone", clone_all),
    ):
        ours, plain = best_of(5, run), best_of(5, baseline)
        rows.append(
            (
                name,
                f"{total / ours / 1e9:.2f} GB/s",
                f"{baseline_name} {total / plain / 1e9:.2f} GB/s",
                f"{plain / ours:.2f}x of plain (target >= 0.5x)",
            )
        )


def bench_lmdb(rows: list[tuple[str, str, str, str]], count: int) -> None:
    blocks = make_blocks(count)
    total = count * LAYOUT.nbytes
    with tempfile.TemporaryDirectory() as folder:
        clock = time.monotonic
        tier = LMDBTier(Path(folder) / "lmdb", LAYOUT, total * 2, make_policy("lru", clock=clock), clock=clock)
        for block in blocks:
            tier.put(block)
        tier.flush()
        plain = Path(folder) / "plain.bin"
        with plain.open("wb") as file:
            for block in blocks:
                file.write(block.kv.numpy().tobytes())

        def lmdb_get_all() -> None:
            for block in blocks:
                tier.get(block.key, block.tokens)

        def file_read_all() -> None:
            with plain.open("rb", buffering=0) as file:
                for _ in range(count):
                    buffer = bytearray(LAYOUT.nbytes)
                    file.readinto(buffer)
                    torch.frombuffer(buffer, dtype=torch.float32)

        lmdb_get_all()  # both from a warm page cache
        file_read_all()
        ours, baseline = best_of(5, lmdb_get_all), best_of(5, file_read_all)
        rows.append(
            (
                "LMDB tier get (verified)",
                f"{total / ours / 1e9:.2f} GB/s",
                f"plain file read {total / baseline / 1e9:.2f} GB/s",
                f"{baseline / ours:.2f}x of plain (target >= 0.5x)",
            )
        )
        tier.close()


def bench_churn(rows: list[tuple[str, str, str, str]]) -> None:
    layout = BlockLayout(shape=(2, 2, 1, 4, 8), dtype=torch.float32)
    namespace = Namespace("churn-model", "churn-tokenizer", "float32", layout.shape)
    store = TieredStore.open(None, layout, StoreConfig(TierConfig(0), TierConfig(400 * layout.nbytes), TierConfig(0)))
    seed = store.seed(namespace)
    size = layout.block_size
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000, 50000) for _ in range(40 * size)] for _ in range(30)]

    def pieces(tokens: list[int]) -> int:
        slots = [store.tiers[0].peek(key) for key in chain_keys(seed, tokens[: 40 * size], size)]
        pointers = [block.kv.data_ptr() for block in slots if block is not None]
        step = size * layout.shape[4] * layout.dtype.itemsize  # one slot further along the pool
        return 1 + sum(after != before + step for before, after in itertools.pairwise(pointers))

    before, lent = [], []
    for request in range(6000):
        prompt = prefixes[min(int(rng.paretovariate(1.0)) - 1, 29)] + [rng.randrange(1000, 50000) for _ in range(9)]
        held = store.held(namespace, prompt).blocks
        store.put(_chain(seed, layout, prompt, min(held, 40)))
        if request >= 2000 and request % 10 == 0:
            before.append(pieces(prompt))
            loan = store.borrow(namespace, prompt, start=0, stop=40)
            lent.append(len(loan.kv))
            loan.give_back()
    store.close()
    rows.append(
        (
            "a 40-block prefix lent under churn",
            f"pieces lent: median {statistics.median(lent):.0f}, most {max(lent)}",
            f"pieces stored: median {statistics.median(before):.0f}, most {max(before)}",
            f"{len(lent)} loans",
        )
    )


def bench_tails(rows: list[tuple[str, str, str, str]]) -> None:
    """Look up and fetch a 64-block prefix that N tails follow (prompts on one system prompt that each stored the
    partial block after it), against the same with 10 tails: the store reads a few of a block's children, not all."""
    few: tuple[float, float] | None = None
    for count in (10, 1000, 10000):
        held, fetched = _prefix_with_tails(count)
        few = few or (held, fetched)
        rows.append(
            (
                f"look up, fetch: a prefix {count} tails follow",
                f"{held * 1e3:.3f} ms, {fetched * 1e3:.3f} ms",
                f"10 tails: {few[0] * 1e3:.3f} ms, {few[1] * 1e3:.3f} ms",
                f"{held / few[0]:.2f}x, {fetched / few[1]:.2f}x",
            )
        )


def _prefix_with_tails(count: int) -> tuple[float, float]:
    """Return the median seconds of `held` and of `fetch` for a prompt on a prefix that `count` tails follow."""
    layout = BlockLayout(shape=(2, 2, 1, 64, 8), dtype=torch.float32)
    namespace = Namespace("tails-model", "tails-tokenizer", "float32", layout.shape)
    size = layout.block_size
    prefix = list(range(1000, 1000 + 64 * size))
    config = StoreConfig(TierConfig(0), TierConfig((count + 100) * layout.nbytes), TierConfig(0))
    store = TieredStore.open(None, layout, config)
    blocks = _chain(store.seed(namespace), layout, prefix)
    store.put(blocks)
    last, zeros = blocks[-1].key, torch.zeros(layout.shape)
    for i in range(count):
        tokens = (50000 + i, 7)
        store.put([Block(tail_key(last, tokens), tokens, zeros, last)])
    prompt = [*prefix, 3, 4, 5]
    out = torch.empty((*layout.shape[:3], len(prompt), layout.shape[4]))
    held = best_of(50, lambda: store.held(namespace, prompt))
    fetched = best_of(50, lambda: store.fetch(namespace, prompt, out))
    store.close()
    return held, fetched


def _chain(seed: bytes, layout: BlockLayout, tokens: list[int], start: int = 0) -> list[Block]:
    """Return the whole blocks of `tokens` from block `start` on, keyed and chained as the store keys them, K and V
    zero."""
    size = layout.block_size
    keys = chain_keys(seed, tokens, size)
    zeros = torch.zeros(layout.shape)
    return [
        Block(keys[i], tuple(tokens[i * size : (i + 1) * size]), zeros, keys[i - 1] if i else None)
        for i in range(start, len(keys))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=128, help="blocks per measurement (2.8 MiB each)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # copies here are memory-bound; one thread is what a store call gets
    rows: list[tuple[str, str, str, str]] = []
    bench_hashing(rows)
    bench_host(rows, args.blocks)
    bench_lmdb(rows, args.blocks)
    bench_churn(rows)
    bench_tails(rows)
    print(f"block: {LAYOUT.shape} {LAYOUT.dtype}, {LAYOUT.nbytes / 2**20:.2f} MiB; {args.blocks} blocks per run")
    header = ("measure", "prefixgate", "baseline", "ratio")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
