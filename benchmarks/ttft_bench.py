"""Time to first token on SmolLM2 for a shared prefix followed by a 32-token question.

Run by hand: `.venv/bin/python benchmarks/ttft_bench.py` (add `--lengths 512 2048` for a quick run). It runs on
the GPU when there is one, with the device tier in GPU memory. For each
prefix length it measures, in one run:
- cold: nothing cached, the whole prompt is computed (in the backend's prefill chunks);
- warm from each tier: the prefix's blocks fetched from a store holding them only in that tier (device, host or
  disk; on a machine without a GPU the device tier is a pool in CPU memory, and disk reads come from the page
  cache) into the buffer the request reserved, as the engine does, then only the question computed;
- warm from Redis (with `--remote URL`): the same from a store whose blocks are only in Redis, fetched in one
  round trip and kept in the host tier as the engine keeps them; the table shows the round trips each fetch made
  (the tier's `round_trips`: the chain streams, each block asked for as the one before it arrives, so the fetch
  waits for Redis once);
- ideal: the same request with the prefix's blocks already in its buffer (fetched from the host tier before the clock
  starts): only the question computed, the floor for any cache.

As a server does, it runs torch on one CPU thread in every thread but the model's (see `prefixgate/threads.py`).
Before it did, its own puts and fetches gave the process a second OpenMP pool, and the model's steps took about twice
as long: at 4k on 2 cores of the Xeon, the ideal 59 ms against 25, warm from the host tier 76 against 45.

Then, at `--offset-length` tokens (4096), prefixes that end at each of `--offsets` tokens into a block: an earlier
request (the prefix and another question) leaves its blocks in a host-tier store as the engine files them, whole
blocks and the tail; the prefix and the question then start from what the store finds, to the token. Offset 0 is the
block-aligned case the others are compared with.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from prefixgate.backends import HFBackend, KVReservation, SamplingParams
from prefixgate.store import (
    Block,
    BlockKey,
    BlockLayout,
    Namespace,
    PrefixHit,
    RemoteConfig,
    StoreConfig,
    TierConfig,
    TieredStore,
    chain_keys,
    tail_key,
)
from prefixgate.threads import torch_executor, use_threads

QUESTION = "Question: according to the report above, which of the listed measures mattered most, and why? Answer:"
OTHER_QUESTION = "Name the node that served the most requests per second in the report above, and say when it did."
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
TIERS = ("device", "host", "disk")


def document_tokens(backend: HFBackend, count: int) -> list[int]:
    """Return `count` tokens of a long, varied, deterministic document."""
    paragraphs = [
        f"Section {i}. In quarter {i % 4 + 1} the team measured {i * 37 % 101} requests per second on node "
        f"{i % 13}, and noted that cache hit rate {i * 7 % 100} percent followed change number {i * 11}."
        for i in range(2000)
    ]
    tokens = backend.render_text("\n".join(paragraphs))
    assert len(tokens) >= count, "the document is too short for this prefix length"
    return tokens[:count]


async def first_token_seconds(
    backend: HFBackend,
    tokens: Sequence[int],
    blocks: Sequence[torch.Tensor],
    reservation: KVReservation | None = None,
) -> float:
    start = time.perf_counter()
    stream = backend.generate(tokens, blocks, FIRST_TOKEN, reservation=reservation)
    await anext(stream)
    seconds = time.perf_counter() - start
    await stream.aclose()
    return seconds


def open_store(
    tier: str, folder: Path, layout: BlockLayout, nbytes: int, device: torch.device, remote: str | None = None
) -> TieredStore:
    """Return a store whose only tier is `tier`; for "remote", Redis below a host tier that blocks are promoted into."""
    local = "host" if tier == "remote" else tier
    budgets = {name: (nbytes if name == local else 0) for name in TIERS}
    config = StoreConfig(
        TierConfig(budgets["device"]),
        TierConfig(budgets["host"]),
        TierConfig(budgets["disk"]),
        remote=RemoteConfig((remote,)) if tier == "remote" and remote is not None else None,
    )
    return TieredStore.open(folder / tier, layout, config, device=device)


async def measure(
    backend: HFBackend, length: int, question: list[int], repeats: int, remote: str | None
) -> dict[str, float]:
    prefix = document_tokens(backend, length)
    tokens = prefix + question
    geometry = backend.geometry
    blocks: dict[int, torch.Tensor] = {}

    def keep(index: int, block_tokens: Sequence[int], kv: torch.Tensor) -> None:
        blocks[index] = kv

    times: dict[str, float] = {}
    start = time.perf_counter()
    stream = backend.generate(tokens, [], FIRST_TOKEN, on_block=keep)
    await anext(stream)
    times["cold"] = time.perf_counter() - start
    await stream.aclose()

    layout = BlockLayout(geometry.block_shape, geometry.dtype)
    namespace = Namespace(backend.fingerprint, backend.tokenizer_hash, layout.dtype_name, layout.shape)
    size = geometry.block_size
    count = length // size
    tiers = (*TIERS, "remote") if remote is not None else TIERS
    samples: dict[str, list[float]] = {name: [] for name in (*tiers, "ideal", "round trips")}
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        stores = {}
        for tier in tiers:
            store = stores[tier] = stack.enter_context(
                open_store(tier, Path(folder), layout, (count + 1) * layout.nbytes, backend.device, remote)
            )
            keys = chain_keys(store.seed(namespace), tokens, size)
            parents = [None, *keys]
            chain = [
                Block(keys[i], tuple(tokens[i * size : (i + 1) * size]), blocks[i], parents[i]) for i in range(count)
            ]
            for begin in range(0, count, 32):  # the disk and Redis writers take at most 256 MiB at a time
                store.put(chain[begin : begin + 32])
                store.wait_for_writes()
            if tier == "remote":
                store.flush("host")  # in Redis only

        async def fetched(store: TieredStore) -> tuple[KVReservation, PrefixHit]:
            """Reserve the request's buffer and fetch the prefix's blocks into it, as the engine does."""
            reservation = await backend.reserve(len(tokens), FIRST_TOKEN.max_tokens)
            return reservation, await asyncio.to_thread(store.fetch, namespace, tokens, reservation.buffer)

        # Rounds of one run each, interleaved, so the machine's slow moments fall on every column alike.
        for _ in range(repeats):
            for tier, store in stores.items():
                trips = _round_trips(store)
                start = time.perf_counter()
                reservation, hit = await fetched(store)
                assert hit.tiers == (tier,) * count, hit.tiers
                await first_token_seconds(backend, tokens, [block.kv for block in hit.blocks], reservation)
                samples[tier].append(time.perf_counter() - start)
                if tier == "remote":
                    samples["round trips"].append(_round_trips(store) - trips)
                    store.flush("host")  # promoted by the fetch: the next round reads Redis again
            reservation, hit = await fetched(stores["host"])  # before the clock: only the question is timed
            samples["ideal"].append(await first_token_seconds(backend, tokens, [b.kv for b in hit.blocks], reservation))
    times.update({name: statistics.median(values) for name, values in samples.items() if values})
    if remote is not None:
        stores["remote"].flush("remote")
    return times


async def measure_offsets(
    backend: HFBackend, length: int, offsets: Sequence[int], question: list[int], other: list[int], repeats: int
) -> dict[int, tuple[float, int]]:
    """Return the median warm time to first token, and the cached tokens, of a prefix ending at each offset."""
    size = backend.geometry.block_size
    document = document_tokens(backend, length + size)
    whole: list[torch.Tensor] = []
    await backend.prefill(document, [], lambda index, tokens, kv: whole.append(kv))  # the document's blocks, once
    geometry = backend.geometry
    layout = BlockLayout(geometry.block_shape, geometry.dtype)
    namespace = Namespace(backend.fingerprint, backend.tokenizer_hash, layout.dtype_name, layout.shape)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for offset in offsets:
            prefix = document[: length + offset]
            with open_store("host", Path(folder), layout, 4 * length // size * layout.nbytes, backend.device) as store:
                seed = store.seed(namespace)
                earlier = prefix + other
                keys = chain_keys(seed, earlier, size)
                cached = whole[: len(prefix) // size]
                parents = [None, *keys]
                store.put(
                    [
                        Block(keys[i], tuple(earlier[i * size : (i + 1) * size]), kv, parents[i])
                        for i, kv in enumerate(cached)
                    ]
                )
                store.put(await run_and_file(backend, earlier, cached, keys))
                tokens = prefix + question
                seconds, hits = [], set()
                for _ in range(repeats):
                    start = time.perf_counter()
                    reservation = await backend.reserve(len(tokens), FIRST_TOKEN.max_tokens)
                    hit = await asyncio.to_thread(store.fetch, namespace, tokens, reservation.buffer)
                    await first_token_seconds(backend, tokens, hit.kv, reservation)
                    seconds.append(time.perf_counter() - start)
                    hits.add(hit.cached_tokens)
                assert len(hits) == 1, hits
                results[offset] = (statistics.median(seconds), hits.pop())
    return results


async def run_and_file(
    backend: HFBackend, tokens: list[int], cached: list[torch.Tensor], keys: list[BlockKey]
) -> list[Block]:
    """Run a request from its cached blocks; return the blocks it computed, keyed as the engine files them: whole
    blocks by their chain keys, the tail after its parent."""
    size = backend.geometry.block_size
    filed: list[Block] = []

    def file(index: int, block_tokens: Sequence[int], kv: torch.Tensor) -> None:
        parent = keys[index - 1] if index else None
        key = keys[index] if len(block_tokens) == size else tail_key(keys[index - 1], block_tokens)
        filed.append(Block(key, tuple(block_tokens), kv, parent))

    async for _ in backend.generate(tokens, cached, FIRST_TOKEN, on_block=file):
        pass
    return filed


def _round_trips(store: TieredStore) -> int:
    """Return the round trips the store's Redis tier has made (0 without one)."""
    stats = store.remote_stats()
    return stats.round_trips if stats is not None else 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8128])
    parser.add_argument("--repeats", type=int, default=9, help="warm and ideal runs per cell (median)")
    parser.add_argument("--json", type=Path, help="also write the medians, in seconds, to this file")
    parser.add_argument("--remote", metavar="URL", help="add a column warm from this Redis (its blocks are deleted)")
    parser.add_argument(
        "--offsets", type=int, nargs="*", default=list(range(0, 64, 8)), help="tokens into a block a prefix ends at"
    )
    parser.add_argument("--offset-length", type=int, default=4096, help="the whole blocks before those offsets")
    args = parser.parse_args()
    backend = await asyncio.to_thread(HFBackend.load, "smollm2-135m")
    if backend.compiling is not None:
        await asyncio.to_thread(backend.compiling.join)  # the steps as served once compiled
    # From here this thread (which puts blocks in stores) and the loop's (fetches) run torch on one CPU thread, as a
    # server's do: the model's thread keeps the only OpenMP pool.
    threads = torch.get_num_threads()  # the default count, which the model took as it loaded
    use_threads(1)
    asyncio.get_running_loop().set_default_executor(torch_executor("ttft-io"))
    try:
        question, other = ((backend.render_text(text) * 2)[:32] for text in (QUESTION, OTHER_QUESTION))
        await first_token_seconds(backend, backend.render_text("warm up the kernels"), [])
        print(
            f"SmolLM2-135M-Instruct, {backend.geometry.dtype}, {backend.device}, {threads} threads, "
            f"steps {backend.steps}; "
            f"blocks of {backend.geometry.block_size} tokens; prompt = prefix + 32-token question; "
            f"median of {args.repeats} warm runs"
        )
        tiers = (*TIERS, "remote") if args.remote is not None else TIERS
        header = ["prefix", "cold", *(f"warm {t}" for t in tiers), "ideal", "cold/warm host", "warm host/ideal"]
        if args.remote is not None:
            header += ["remote/host", "round trips"]
        rows = []
        measured: dict[int, dict[str, float]] = {}
        for length in args.lengths:
            t = measured[length] = await measure(backend, length, question, args.repeats, args.remote)
            row = [
                str(length),
                *(f"{t[name] * 1e3:.0f} ms" for name in ("cold", *tiers, "ideal")),
                f"{t['cold'] / t['host']:.1f}x",
                f"{t['host'] / t['ideal']:.2f}x",
            ]
            if args.remote is not None:
                row += [f"{t['remote'] / t['host']:.2f}x", f"{t['round trips']:g}"]
            rows.append(row)
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, ["-" * w for w in widths], *rows]:
            print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if args.offsets:
            length = args.offset_length
            found = await measure_offsets(backend, length, args.offsets, question, other, args.repeats)
            aligned = found[0][0] if 0 in found else None
            print(
                f"\nA prefix of {length} tokens plus an offset, then the question; an earlier request left the prefix "
                "and another question cached"
            )
            header = ["offset", "prompt", "cached", "warm", "vs aligned"]
            rows = [
                [
                    str(offset),
                    str(length + offset + len(question)),
                    str(cached),
                    f"{seconds * 1e3:.0f} ms",
                    f"{seconds / aligned:.2f}x" if aligned else "",
                ]
                for offset, (seconds, cached) in found.items()
            ]
            widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
            for row in [header, ["-" * w for w in widths], *rows]:
                print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if args.json is not None:
            args.json.write_text(json.dumps({"device": str(backend.device), "seconds": measured}, indent=1))
    finally:
        await backend.aclose()


if __name__ == "__main__":
    asyncio.run(main())
