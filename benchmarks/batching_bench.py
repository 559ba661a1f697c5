"""Serve many streams at once on SmolLM2 through HTTP, and measure what batching and chunked prefill give.

Run by hand: `.venv/bin/python benchmarks/batching_bench.py` (about twenty minutes; `--running 1` and `--batches 1 8`
make it shorter). It starts `prefixgate serve` on 127.0.0.1 with its store in memory; every long prompt shares no
prefix with another, so each is computed whole. It prints two tables:

1. In float32 (the dtype of the batched forward it is compared with): aggregate decode tokens/s of 1, 4, 8, 16 and 32
   concurrent streams (64 tokens each, greedy), counted while all of them are decoding, with inter-token latency and
   time to first token; next to the limit, a plain batched forward pass of the same model at the same batch size (one
   new token per row, short context), in this process, measured just before each round's streams while the server
   idles. `--rounds` (default 3) rounds of each count; the table gives the round with the median ratio, and every
   round's ratio (lowest first), since a 2-core machine's speed drifts by up to a fifth between runs.
2. For 1, 4 and 8 running streams (`--running`), served as `prefixgate serve` serves by default (bfloat16 where the
   CPU computes it): their inter-token latency while idle and while a cold 8k-token prompt is prefilled beside them
   (the median and the 90th percentile of the gaps), and that prompt's time to first token next to its time alone.

`--prefixgate PATH` runs another build's `prefixgate` executable (table 1 only needs flags every build has);
`--flag` passes a flag to `serve` for table 2 (repeat it: `--flag=--interleaved-prefill-tokens --flag=80`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

MODEL = "smollm2-135m"
STREAM_TOKENS = 64
LONG_PROMPT_TOKENS = 8000
FLOAT32 = ("--dtype", "float32")  # the server runs in the batched forward's dtype, which it is compared with


@dataclass
class Stream:
    """What one streamed answer delivered: when it was sent and when each piece of text arrived."""

    sent: float
    arrivals: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Return the gaps between consecutive pieces that both arrived within [start, end]."""
        inside = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in itertools.pairwise(inside)]


def own_prefixgate() -> str:
    """Return the `prefixgate` executable beside this Python, or the one on PATH where there is none beside it (an
    install with `pip install --target`, say)."""
    beside = Path(sys.executable).parent / "prefixgate"
    return str(beside) if beside.exists() else shutil.which("prefixgate") or str(beside)


@dataclass(frozen=True)
class Served:
    """A running server: its base URL and its process id."""

    url: str
    pid: int


@contextlib.asynccontextmanager
async def served(executable: str, *flags: str) -> AsyncIterator[Served]:
    """Run `prefixgate serve` (store in memory) on a free local port; yield it once it answers."""
    async with launched(lambda port: [executable, "serve", "--port", str(port), "--store", "", *flags]) as server:
        yield server


@contextlib.asynccontextmanager
async def launched(command: Callable[[int], list[str]]) -> AsyncIterator[Served]:
    """Run a server's `command(port)` on a free local port; yield it once its /health answers 200 (and, for
    prefixgate, its steps are no longer compiling)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Its log goes to a file: a pipe nobody reads fills up and stops a server that logs every request.
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command(port), stdout=subprocess.DEVNULL, stderr=log)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                while True:
                    if process.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(f"the server exited: {log.read().decode()[-2000:]}")
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"{url}/health") as response:
                            # prefixgate compiles its steps after it starts: measure them as they run from then on
                            if response.status == 200 and '"compiling"' not in await response.text():
                                break
                    await asyncio.sleep(0.2)
            yield Served(url, process.pid)
        finally:
            process.terminate()
            process.wait()


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    content: str,
    max_tokens: int,
    into: list[Stream] | None = None,
    **fields: Any,
) -> Stream:
    """Send one streamed chat request (with `fields` added to its body) and record when each piece of its answer
    arrives (also in `into`, at once)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **fields,
    }
    record = Stream(time.perf_counter())
    if into is not None:
        into.append(record)
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            # A chunk with text; matched, not parsed, so the client takes little of the CPU the server runs on.
            if line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
                record.arrivals.append(time.perf_counter())
    return record


async def concurrent_streams(url: str, count: int) -> tuple[float, float, float]:
    """Run `count` streams at once; return decode tokens/s while all decode, inter-token p50 and TTFT p50."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        streams = await asyncio.gather(
            *(
                stream(session, url, f"Write a long story about the number {i * 1000}.", STREAM_TOKENS)
                for i in range(count)
            )
        )
    start = max(s.arrivals[0] for s in streams)  # all are decoding from here ...
    end = min(s.arrivals[-1] for s in streams)  # ... to here
    pieces = sum(len([t for t in s.arrivals if start < t <= end]) for s in streams)
    gaps = [gap for s in streams for gap in s.gaps()]
    return pieces / (end - start), statistics.median(gaps), statistics.median(s.ttft for s in streams)


class BatchedForward:
    """The limit: a plain batched decode step of the same model in this process, one new token per row."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from prefixgate.backends import resolve_model

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(resolve_model(MODEL).folder), dtype=torch.float32)
        self.model.eval()

    def tokens_per_second(self, batch: int) -> float:
        """Return tokens/s of decode steps at `batch` rows, each after a short context (32 to 40 tokens)."""
        from transformers import DynamicCache

        torch, model = self.torch, self.model
        times = []
        with torch.inference_mode():
            for _ in range(3):
                cache = DynamicCache(config=model.config)
                model(torch.randint(0, 1000, (batch, 32)), past_key_values=cache, use_cache=True)
                for _ in range(8):
                    started = time.perf_counter()
                    model(torch.randint(0, 1000, (batch, 1)), past_key_values=cache, use_cache=True, logits_to_keep=1)
                    times.append(time.perf_counter() - started)
        return batch / statistics.median(times)


def long_prompt(variant: int) -> str:
    """Return a user message of about LONG_PROMPT_TOKENS tokens; variants differ from their first token on."""
    from transformers import AutoTokenizer

    from prefixgate.backends import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL).folder))
    lines = [
        f"Entry {variant}.{i}: station {i % 17} logged {i * 37 % 101} readings at hour {i % 24}, "
        f"with {i * 7 % 100} percent within range after calibration {i * 11}."
        for i in range(1200)
    ]
    ids = tokenizer(f"Log {variant}.\n" + "\n".join(lines))["input_ids"][:LONG_PROMPT_TOKENS]
    return str(tokenizer.decode(ids)) + "\nWhich station logged the most readings?"


async def prefill_beside_streams(url: str, prompt: str, running: int, idle_seconds: float) -> Beside:
    """Run `running` streams, then a cold long prompt beside them; return their gaps idle and during, and its TTFT."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        records: list[Stream] = []
        stop = asyncio.Event()

        async def keep_streaming(i: int) -> None:
            while not stop.is_set():  # an answer that ends is followed by another, so the stream never pauses
                await stream(session, url, f"Write a long story about the number {i * 1000}.", 512, records)

        runners = [asyncio.create_task(keep_streaming(i)) for i in range(running)]
        await asyncio.sleep(3.0)  # past every stream's first token
        idle_start = time.perf_counter()
        await asyncio.sleep(idle_seconds)
        long = await stream(session, url, prompt, 1)
        stop.set()
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
    idle = [g for r in records for g in r.gaps(idle_start, long.sent)]
    during = [g for r in records for g in r.gaps(long.sent, long.arrivals[0])]
    return Beside(idle, during, long.ttft)


@dataclass(frozen=True)
class Beside:
    """Running streams' gaps between pieces while idle and while a long prompt was prefilled, and its TTFT."""

    idle: list[float]
    during: list[float]
    ttft: float


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def alone(url: str, prompt: str) -> float:
    """Return the time to first token of one prompt with nothing else running."""
    async with aiohttp.ClientSession() as session:
        return (await stream(session, url, prompt, 1)).ttft


def rate(streams: list[Stream], start: float, end: float) -> float:
    """Return the pieces of text the streams delivered per second within (start, end]."""
    return sum(len([t for t in s.arrivals if start < t <= end]) for s in streams) / (end - start)


def streams_options(description: str) -> argparse.Namespace:
    """Parse the options of a benchmark running rounds of concurrent streams against `prefixgate serve`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flag", action="append", default=[], help="a flag for `prefixgate serve` (repeat it)")
    return parser.parse_args()


def in_turn(
    runs: list[Callable[[], object]], repeats: int, before: Callable[[], object] = lambda: None
) -> list[list[float]]:
    """Run each in turn `repeats` times after a warm-up round, each after `before`, the order reversed every other
    round (the first of a round can measure slower than the same work later in it); return each one's times, in
    seconds."""
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(repeats + 1):
        turns = list(zip(times, runs, strict=True))
        for measured, run in turns[:: -1 if round_ % 2 else 1]:
            before()
            start = time.perf_counter()
            run()
            if round_:
                measured.append(time.perf_counter() - start)
    return times


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    print()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each stream count")
    parser.add_argument("--running", type=int, nargs="*", default=[1, 4, 8], help="streams beside the long prompt")
    parser.add_argument("--flag", action="append", default=[], help="a flag for `prefixgate serve` (table 2)")
    parser.add_argument("--prefixgate", default=own_prefixgate())
    args = parser.parse_args()
    import torch

    print(f"SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {os.cpu_count()} cores\n")
    if args.batches:
        limit = BatchedForward()
        rows = []
        async with served(args.prefixgate, *FLOAT32) as server:
            url = server.url
            await concurrent_streams(url, 2)  # warm up
            for count in args.batches:
                # Each round measures the limit (the server idle) just before the streams, so the machine's drift
                # falls on both alike.
                rounds = []
                for _ in range(args.rounds):
                    bound = limit.tokens_per_second(count)
                    rounds.append((bound, *await concurrent_streams(url, count)))
                rounds.sort(key=lambda r: r[1] / r[0])
                bound, rate, itl, ttft = rounds[len(rounds) // 2]  # the round whose ratio is the median
                rows.append(
                    [
                        str(count),
                        f"{rate:.1f}",
                        f"{bound:.1f}",
                        f"{rate / bound:.2f}x",
                        " ".join(f"{r[1] / r[0]:.2f}" for r in rounds),
                        f"{itl * 1e3:.0f} ms",
                        f"{ttft:.2f} s",
                    ]
                )
        print(f"Concurrent streams of {STREAM_TOKENS} tokens, through HTTP (the median of {args.rounds} rounds):")
        header = ["streams", "tokens/s", "batched forward", "of limit", "each round", "inter-token p50", "TTFT p50"]
        table(header, rows)
    if args.running:
        rows = []
        for index, running in enumerate(args.running):
            async with served(args.prefixgate, *args.flag) as server:
                url = server.url
                await concurrent_streams(url, 2)  # warm up
                # Two prompts of the same length that share no prefix: each is computed whole.
                beside = await prefill_beside_streams(url, long_prompt(2 * index), running, idle_seconds=3.0)
                by_itself = await alone(url, long_prompt(2 * index + 1))
            idle, p50, p90 = (
                statistics.median(beside.idle),
                statistics.median(beside.during),
                percentile(beside.during, 0.9),
            )
            rows.append(
                [
                    str(running),
                    f"{idle * 1e3:.0f} ms",
                    f"{p50 * 1e3:.0f} ms",
                    f"{p50 / idle:.1f}x",
                    f"{p90 * 1e3:.0f} ms",
                    f"{p90 / idle:.1f}x",
                    f"{beside.ttft:.1f} s",
                    f"{by_itself:.1f} s",
                    f"{beside.ttft / by_itself:.2f}x",
                ]
            )
        flags = " ".join(args.flag) or "the defaults"
        print(f"A cold {LONG_PROMPT_TOKENS}-token prompt arriving beside running streams ({flags}):")
        header = ["streams", "ITL idle", "during p50", "ratio", "p90", "ratio", "its TTFT", "TTFT alone", "ratio"]
        table(header, rows)


if __name__ == "__main__":
    asyncio.run(main())
