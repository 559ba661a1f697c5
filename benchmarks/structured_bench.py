"""What constrained decoding costs: 8 streams through HTTP on SmolLM2, with and without a JSON schema to follow.

Run by hand: `.venv/bin/python benchmarks/structured_bench.py` (about two minutes). It starts `prefixgate serve`
(store in memory) and runs `--streams` concurrent streams of 64 tokens each, greedy, in three ways: plain text, each
answer held to a JSON schema (`response_format` `json_schema`: an object with a list of at least 40 strings, so no
answer ends before its tokens run out), and half of each. It prints the aggregate decode tokens/s while all streams
decode (the best of `--rounds` rounds) and each way's rate against plain text; in the mixed way, also the rate of the
unconstrained half against the constrained half.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from batching_bench import Stream, own_prefixgate, rate, served, stream, streams_options, table

TOKENS = 64
SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["lines"],
    "additionalProperties": False,
}


async def send(session: aiohttp.ClientSession, url: str, index: int, constrained: bool) -> Stream:
    """Stream one answer; record when each piece arrives."""
    schema = {"type": "json_schema", "json_schema": {"name": "facts", "schema": SCHEMA}}
    fields = {"response_format": schema} if constrained else {}
    return await stream(session, url, f"List {40 + index} facts about the number {index * 1000}.", TOKENS, **fields)


async def run(url: str, streams: int, constrained: list[bool]) -> tuple[float, float, float]:
    """Run one round; return the decode rate of all streams, of the unconstrained ones and of the constrained ones."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        records = await asyncio.gather(*(send(session, url, i, constrained[i]) for i in range(streams)))
    start = max(s.arrivals[0] for s in records)
    end = min(s.arrivals[-1] for s in records)
    plain = [s for s, c in zip(records, constrained, strict=True) if not c]
    held = [s for s, c in zip(records, constrained, strict=True) if c]
    return rate(records, start, end), rate(plain, start, end) if plain else 0.0, rate(held, start, end) if held else 0.0


async def main() -> None:
    args = streams_options(__doc__)
    executable = own_prefixgate()
    ways = {
        "plain text": [False] * args.streams,
        "JSON schema": [True] * args.streams,
        "half and half": [i % 2 == 1 for i in range(args.streams)],
    }
    print(f"SmolLM2-135M-Instruct, CPU, {os.cpu_count()} cores; {args.streams} streams of {TOKENS} tokens; {args.flag}")
    async with served(executable, *args.flag) as server:
        await run(server.url, args.streams, ways["JSON schema"])  # warm up: grammars, buffers, the first steps
        results = {}
        for name, constrained in ways.items():
            rounds = [await run(server.url, args.streams, constrained) for _ in range(args.rounds)]
            results[name] = max(rounds)
    base = results["plain text"][0]
    rows = [[name, f"{total:.1f}", f"{total / base:.2f}x"] for name, (total, _, _) in results.items()]
    table(["streams", "decode tokens/s", "against plain text"], rows)
    _, plain, held = results["half and half"]
    print(f"\nhalf and half: the unconstrained streams {plain:.1f} tokens/s, the constrained ones {held:.1f}")


if __name__ == "__main__":
    asyncio.run(main())
