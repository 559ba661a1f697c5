"""What sampling costs against greedy picks: 8 streams through HTTP on SmolLM2.

Run by hand: `.venv/bin/python benchmarks/sampling_bench.py` (about two minutes). It starts `prefixgate serve` (store
in memory) and runs `--streams` concurrent streams of 64 tokens each (`ignore_eos`, so none ends early), picking
tokens in four ways: greedy (`temperature` 0), the API's default (`temperature` 1), `temperature` 0.7 with `top_p`
0.9, and `temperature` 0.7 with `top_k` 50. It prints the aggregate decode tokens/s while all streams decode (the
best of `--rounds` rounds) and each way's rate against greedy. Every stream picks its own token after each step, in
the step's thread, so what a pick costs is paid once per stream per step.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from batching_bench import own_prefixgate, rate, served, stream, streams_options, table

TOKENS = 64
WAYS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
}


async def run(url: str, streams: int, fields: dict[str, Any]) -> float:
    """Run one round; return the decode rate of all streams while every one of them decodes."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        records = await asyncio.gather(
            *(
                stream(session, url, f"Tell me about the number {i * 1000}.", TOKENS, ignore_eos=True, **fields)
                for i in range(streams)
            )
        )
    return rate(records, max(s.arrivals[0] for s in records), min(s.arrivals[-1] for s in records))


async def main() -> None:
    args = streams_options(__doc__)
    executable = own_prefixgate()
    print(f"SmolLM2-135M-Instruct, CPU, {os.cpu_count()} cores; {args.streams} streams of {TOKENS} tokens; {args.flag}")
    async with served(executable, *args.flag) as server:
        await run(server.url, args.streams, WAYS["temperature 1"])  # warm up: buffers, the first steps
        results = {}
        for name, fields in WAYS.items():
            results[name] = max([await run(server.url, args.streams, fields) for _ in range(args.rounds)])
    base = results["greedy"]
    rows = [[name, f"{rate:.1f}", f"{rate / base:.2f}x"] for name, rate in results.items()]
    table(["picks", "decode tokens/s", "against greedy"], rows)


if __name__ == "__main__":
    asyncio.run(main())
