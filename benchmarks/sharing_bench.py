"""Many streams on one long cached prefix, through HTTP on SmolLM2: what sharing the prefix gives.

Run by hand: `.venv/bin/python benchmarks/sharing_bench.py` (six to seven minutes on 2 cores; `--prefixes 4096` and
`--streams 8` make it shorter). It starts `prefixgate serve` on 127.0.0.1 with its store in memory, caches a system
prompt of each length with one request, then prints:

1. Aggregate decode tokens/s of N concurrent streams (64 tokens each, greedy, the end of text ignored so that none
   stops early; counted while all of them decode) with a short prompt, and with distinct questions after the cached
   system prompt (after a first round on it, not counted); the ratio of the two (nan when the streams never all
   decoded at once).
2. The first token of one warm request alone (a new question after the cached prefix; the median of 3), and the
   slowest first token of N warm requests sent at once; the ratio of the two; and the first tokens of one warm
   request of N choices (`n`; its choices start streaming together).
3. KV memory for 32 streams on the 4k prefix, at its highest while they run: the shared prefix's bytes, read in place
   in the host tier (`prefixgate_kv_shared_bytes`), and the streams' own, which admission counts
   (`prefixgate_kv_memory_bytes`); the server's resident memory added (the prefix was in the host tier before); and
   whether all were admitted without a 429.

Each row of 1 and 2 is measured in `--rounds` rounds (3; each round short prompts, the prefix, one alone, N at once),
so that a machine whose speed drifts meets both sides of a ratio alike: the medians are printed, and each ratio's
median with its lowest and highest.

`--prefixgate PATH` runs another build's `prefixgate` executable (before sharing, say); `--against PATH` runs another
build beside this one (repeat it), each measured in turn in every round, so that two builds compare on a machine whose
speed drifts (each row then names its build; table 3 is this build's alone). `--flag` passes a flag to
`serve` (repeat it: `--flag=--dtype --flag=bfloat16`), `--json FILE` also writes the tables to FILE (as
`benchmarks/gpu_check.sh` reads them). `--llama-server PATH --gguf FILE` runs llama.cpp's server
instead, on the same weights converted to GGUF, with one slot per stream (tables 1 and 2; it reports no KV memory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import time
from pathlib import Path

import aiohttp
from batching_bench import MODEL, STREAM_TOKENS, Stream, launched, own_prefixgate, served, table

_TEXT = re.compile(rb'"content": ?"(?!")')  # a chunk with text
_CACHED = re.compile(rb'"cached_tokens": ?(\d+)')


def system_prompt(tokens: int) -> str:
    """Return a system prompt of about `tokens` tokens: a manual of numbered rules."""
    from transformers import AutoTokenizer

    from prefixgate.backends import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL).folder))
    lines = [
        f"Rule {i}: when a customer asks about order class {i % 23}, check warehouse {i * 7 % 41} first, "
        f"offer a refund within {i % 30 + 1} days, and escalate after {i % 5 + 2} replies."
        for i in range(tokens // 20 + 50)
    ]
    ids = tokenizer("You are the support assistant of a shop.\n" + "\n".join(lines))["input_ids"][:tokens]
    return str(tokenizer.decode(ids))


def question(index: int) -> str:
    return f"Customer {index * 7919 % 100_000} asks: write a long story about order number {index * 1000}."


async def send(
    session: aiohttp.ClientSession, url: str, system: str | None, content: str, max_tokens: int, n: int = 1
) -> tuple[Stream, int]:
    """Stream one chat answer (of `n` choices); return when its pieces arrived and how many prompt tokens came from
    the cache."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        # Every answer runs its full length: one that ended after a few tokens left no time when all decoded at once.
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | ({"n": n} if n > 1 else {})
    record = Stream(time.perf_counter())
    cached = 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {await response.text()}")
        async for line in response.content:
            # Matched, not parsed, so the client takes little of the CPU the server runs on; JSON with or without
            # spaces (llama.cpp's server writes none).
            if line.startswith(b"data: {") and _TEXT.search(line):
                record.arrivals.append(time.perf_counter())
            elif found := _CACHED.search(line):
                cached = int(found.group(1))
    return record, cached


async def decode_rate(url: str, system: str | None, count: int, first: int) -> float:
    """Run `count` streams at once; return their aggregate decode tokens/s while all of them decode."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(
            *(send(session, url, system, question(first + i), STREAM_TOKENS) for i in range(count))
        )
    streams = [record for record, _ in results]
    start = max(s.arrivals[0] for s in streams)
    end = min(s.arrivals[-1] for s in streams)
    if end <= start:
        return float("nan")  # the first stream ended before the last began: they never all decoded at once
    pieces = sum(len([t for t in s.arrivals if start < t <= end]) for s in streams)
    return pieces / (end - start)


async def first_tokens(url: str, system: str, count: int, first: int, *, warm: bool = True, n: int = 1) -> list[float]:
    """Send `count` requests of `n` choices at once (new questions after the prefix); return their first-token
    times. With `warm`, each must say it found part of its prompt cached (not asked of llama.cpp's server)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(send(session, url, system, question(first + i), 1, n) for i in range(count)))
    if warm and not all(cached for _, cached in results):
        raise RuntimeError("a warm request found nothing cached")
    return [record.ttft for record, _ in results]


async def gauge(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(f"{url}/metrics") as response:
        for line in (await response.text()).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def memory_of(url: str, system: str, count: int, pid: int, first: int) -> tuple[float, float, float, int]:
    """Run `count` streams on the cached prefix; return the most KV bytes held (shared prefix and the streams' own),
    the shared bytes then, the resident memory added (MiB), and the requests refused."""
    rss_before = _rss(pid)
    highest, shared = 0.0, 0.0
    refused = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(index: int) -> None:
            nonlocal refused
            try:
                await send(session, url, system, question(index), STREAM_TOKENS)
            except RuntimeError as error:
                refused += str(error).startswith("429")

        tasks = [asyncio.create_task(one(first + i)) for i in range(count)]
        rss_peak = rss_before
        while not all(task.done() for task in tasks):
            own = await gauge(session, url, "prefixgate_kv_memory_bytes")
            lent = await gauge(session, url, "prefixgate_kv_shared_bytes")
            if own + lent > highest:
                highest, shared = own + lent, lent
            rss_peak = max(rss_peak, _rss(pid))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    return highest, shared, (rss_peak - rss_before) / 2**20, refused


def _median(values: list[float]) -> float:
    """The median of the rounds' values that are numbers (nan where none is)."""
    numbers = [value for value in values if not math.isnan(value)]
    return statistics.median(numbers) if numbers else math.nan


def _spread(values: list[float], form: str) -> str:
    """The median of the rounds' values, their lowest and highest where there are several, and how many rounds gave
    no value (nan: the streams never all decoded at once)."""
    numbers = [value for value in values if not math.isnan(value)]
    text = form.format(_median(numbers))
    if len(numbers) > 1:
        text += f" ({form.format(min(numbers))} to {form.format(max(numbers))})"
    if len(numbers) < len(values):
        text += f" [{len(values) - len(numbers)} of {len(values)} rounds nan]"
    return text


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, nargs="*", default=[4096, 7168], help="system prompt tokens")
    parser.add_argument("--streams", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--memory-streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="measures of each row, their median printed")
    parser.add_argument("--prefixgate", default=own_prefixgate())
    parser.add_argument("--against", action="append", default=[], help="another build's prefixgate, in the same rounds")
    parser.add_argument("--flag", action="append", default=[], help="a flag for `prefixgate serve`")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server executable, run instead of prefixgate")
    parser.add_argument("--gguf", help="the model file llama-server runs")
    parser.add_argument("--json", type=Path, help="also write the tables to this file")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds needs 1 or more")
    peer = args.llama_server is not None
    if peer and args.against:
        parser.error("--against compares prefixgate builds; llama.cpp's server runs alone")
    import torch

    # `prefixgate serve` runs on CUDA when torch sees it, unless a flag says otherwise.
    device = "CUDA" if torch.cuda.is_available() else "CPU"
    print(f"SmolLM2-135M-Instruct, {device}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; {args.flag}\n")
    builds = [args.prefixgate, *args.against]
    rates: dict[str, list[list[str]]] = {build: [] for build in builds}
    arrivals: dict[str, list[list[str]]] = {build: [] for build in builds}
    memory = None
    async with contextlib.AsyncExitStack() as stack:
        if peer:
            slots = max(args.streams, default=1)
            context = slots * (max(args.prefixes, default=0) + 1024)  # one slot per stream, each with the whole prompt
            command = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port"]
            options = ["-np", str(slots), "-c", str(context), *args.flag]
            servers = [await stack.enter_async_context(launched(lambda port: [*command, str(port), *options]))]
        else:
            servers = [await stack.enter_async_context(served(build, *args.flag)) for build in builds]
        urls = dict(zip(builds, (server.url for server in servers), strict=True))
        for url in urls.values():
            await decode_rate(url, None, 2, 0)  # warm up
        asked = 1000  # every question is new: only the system prompt is cached
        for tokens in args.prefixes:
            system = system_prompt(tokens)
            for url in urls.values():
                await first_tokens(url, system, 1, asked, warm=False)  # caches the prefix
            asked += 1
            for count in args.streams:
                # llama.cpp's server keeps a prompt per slot: a first round on the prefix puts it in every slot the
                # counted ones use (prefixgate holds it once either way).
                for url in urls.values():
                    await decode_rate(url, system, count, asked)
                asked += count
                rounds: dict[str, list[tuple[float, float, float, float]]] = {build: [] for build in builds}
                for _ in range(args.rounds):  # each build, short and shared in turn: a machine's drift meets them alike
                    for build, url in urls.items():
                        short = await decode_rate(url, None, count, asked)
                        shared = await decode_rate(url, system, count, asked + count)
                        alone = statistics.median(
                            [
                                (await first_tokens(url, system, 1, asked + 2 * count + i, warm=not peer))[0]
                                for i in range(3)
                            ]
                        )
                        slowest = max(await first_tokens(url, system, count, asked + 2 * count + 3, warm=not peer))
                        # llama.cpp's server answers one choice a request
                        choices = (
                            math.nan
                            if peer
                            else (await first_tokens(url, system, 1, asked + 3 * count + 3, n=count))[0]
                        )
                        rounds[build].append((short, shared, alone, slowest, choices))
                    asked += 3 * count + 4
                for build, measured in rounds.items():
                    shorts, shareds, alones, slowests, choice_firsts = (
                        list(column) for column in zip(*measured, strict=True)
                    )
                    ratios = [shared / short for short, shared in zip(shorts, shareds, strict=True)]
                    rates[build].append(
                        [
                            str(tokens),
                            str(count),
                            f"{_median(shorts):.1f}",
                            f"{_median(shareds):.1f}",
                            _spread(ratios, "{:.2f}x"),
                        ]
                    )
                    lateness = [slowest / alone for alone, slowest in zip(alones, slowests, strict=True)]
                    arrivals[build].append(
                        [
                            str(tokens),
                            str(count),
                            f"{statistics.median(alones) * 1e3:.0f} ms",
                            f"{statistics.median(slowests) * 1e3:.0f} ms",
                            _spread(lateness, "{:.1f}x"),
                            "-" if peer else f"{statistics.median(choice_firsts) * 1e3:.0f} ms",
                        ]
                    )
            if tokens == args.prefixes[0] and args.memory_streams and not peer:
                memory = (
                    tokens,
                    *await memory_of(urls[args.prefixgate], system, args.memory_streams, servers[0].pid, asked),
                )
                asked += args.memory_streams
    # With other builds, each row says whose it is.
    named = (lambda build, row: [build, *row]) if args.against else (lambda build, row: row)
    first = ["build"] if args.against else []
    print(f"Decode tokens/s of concurrent streams ({STREAM_TOKENS} tokens each), a short prompt or the cached prefix:")
    rows = [named(build, row) for build in builds for row in rates[build]]
    table([*first, "prefix", "streams", "short prompt", "shared prefix", "ratio"], rows)
    print("First token of warm requests (new questions after the cached prefix):")
    rows = [named(build, row) for build in builds for row in arrivals[build]]
    table(
        [*first, "prefix", "at once", "one alone", "slowest of them", "ratio", "one request of as many choices"], rows
    )
    if args.json is not None:
        tables = {
            "device": device,
            "flags": args.flag,
            "decode": rates[args.prefixgate],
            "arrivals": arrivals[args.prefixgate],
            "memory": memory,
            "against": {build: {"decode": rates[build], "arrivals": arrivals[build]} for build in args.against},
        }
        args.json.write_text(json.dumps(tables, indent=1))
    if memory is not None:
        tokens, highest, shared, rss, refused = memory
        print(f"KV memory of {args.memory_streams} streams on the {tokens}-token prefix:")
        table(
            ["held at most", "the shared prefix", "the streams' own", "resident memory added", "refused"],
            [
                [
                    f"{highest / 2**20:.0f} MiB",
                    f"{shared / 2**20:.0f} MiB",
                    f"{(highest - shared) / 2**20:.0f} MiB",
                    f"{rss:.0f} MiB",
                    str(refused),
                ]
            ],
        )


if __name__ == "__main__":
    asyncio.run(main())
