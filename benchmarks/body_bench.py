"""How long `/health` waits while the largest allowed body is handled.

Run by hand: `.venv/bin/python benchmarks/body_bench.py` (under a minute). It starts `prefixgate serve` (store in
memory, `max_body_bytes` 16 MiB), then sends bodies as large as allowed (a chat body of one-word messages, the same
with its last message invalid, and one of a single 16 MB message) while another connection asks `/health` every
10 ms, and prints for each body its size, the time to its answer (a 400: none fits SmolLM2's context, and one fails
validation), and the longest and median `/health` round trip meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from batching_bench import MODEL, own_prefixgate, served, table

LIMIT = 16 << 20


def bodies() -> dict[str, bytes]:
    """Return the bodies to send, each just under the body limit."""
    one = json.dumps({"role": "user", "content": "word"})
    count = (LIMIT - 100) // (len(one) + 2)
    many = json.dumps({"model": MODEL, "messages": [json.loads(one)] * count}).encode()
    invalid = json.dumps({"model": MODEL, "messages": [json.loads(one)] * (count - 1) + [{"role": "x", "content": ""}]})
    single = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * ((LIMIT - 200) // 5)}]})
    return {
        f"{count:,} one-word messages": many,
        "the same, the last one invalid": invalid.encode(),
        "one message of 16 MB": single.encode(),
    }


async def measure(url: str, raw: bytes) -> tuple[float, int, list[float]]:
    """Send `raw` while polling /health; return the body's time and status, and each /health round trip."""
    rounds: list[float] = []
    async with aiohttp.ClientSession() as bodies_session, aiohttp.ClientSession() as health_session:
        start = time.perf_counter()
        sent = asyncio.create_task(
            bodies_session.post(f"{url}/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
        )
        while not sent.done():
            asked = time.perf_counter()
            async with health_session.get(f"{url}/health") as response:
                await response.read()
            rounds.append(time.perf_counter() - asked)
            await asyncio.sleep(0.01)
        response = await sent
        await response.read()
        return time.perf_counter() - start, response.status, rounds


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixgate", default=own_prefixgate())
    args = parser.parse_args()
    rows = []
    async with served(args.prefixgate, "--max-body-bytes", "16MiB") as server:
        for name, raw in bodies().items():
            await measure(server.url, raw)  # once to warm up
            seconds, status, rounds = await measure(server.url, raw)
            rows.append(
                [
                    name,
                    f"{len(raw) / (1 << 20):.1f} MiB",
                    f"{status} in {seconds * 1e3:.0f} ms",
                    f"{max(rounds) * 1e3:.1f} ms",
                    f"{statistics.median(rounds) * 1e3:.1f} ms",
                    str(len(rounds)),
                ]
            )
    table(["body", "size", "answer", "/health longest", "median", "asked"], rows)


if __name__ == "__main__":
    asyncio.run(main())
