"""Preparation time of a prompt against its size, for adversarial and plain inputs, on SmolLM2's tokenizer.

Run by hand: `.venv/bin/python benchmarks/prepare_bench.py` (add `--sizes 10000 100000` for a quick run). For each
input kind and size (in characters) it prints the median, over `--repeats` runs, of:
- rules: canonicalization and layout alone (the text rules, the dynamic-value patterns and the overlap check);
- prepare: the engine's whole preparation (rules, chat template, the context checks, tokenizing, block keys), in
  its worker thread, as a request gets it; a prompt beyond the context is refused, and counts until the refusal;
- loop stall: the longest the event loop went without running a 1 ms ticker during `prepare`. Preparation runs in
  a worker thread, so this is not its time but the longest the thread holds the GIL in one go: Python's `re` keeps
  it for a whole search, so one pattern's scan of a long text without a match is one stall;
- x: each time over the one for the previous size; linear work grows as much as the input (10x input, about 10x).
The kinds are the known worst cases ("request id" and then only spaces; thousands of dates), labels chained inside
one long token, and plain prose in a system or a user message. Every run scans its text as one never seen before:
layout remembers the values it found in a long text, which a request repeating a system prompt gets at once.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefixgate.backends import HFBackend, SamplingParams
from prefixgate.errors import ContextLengthError
from prefixgate.proxy import layout
from prefixgate.proxy.canonicalize import canonicalize_messages
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.layout import lay_out
from prefixgate.store import BlockLayout, StoreConfig, TierConfig, TieredStore

Messages = list[dict[str, Any]]
PROSE = (
    "The committee reviewed the quarterly figures, noted that throughput rose on every node, and asked the team to "
    "write down which of the measures mattered most. "
)


def request_id_and_spaces(size: int) -> Messages:
    """Return the request-id pattern's worst case: a system prompt of "request id", then nothing but spaces."""
    return chat("request id" + " " * (size - len("request id")))


def chained_labels(size: int) -> Messages:
    """Return a system prompt of request-id labels chained inside one token, none with a digit."""
    return chat(("request_id:" * (size // 11 + 1))[:size])


def dates(size: int) -> Messages:
    """Return a system prompt of distinct ISO dates, each one a value that layout moves."""
    days = (f"{1900 + i // 336 % 200}-{i // 28 % 12 + 1:02d}-{i % 28 + 1:02d}" for i in range(size // 11 + 1))
    return chat(" ".join(days)[:size])


def system_prose(size: int) -> Messages:
    """Return plain prose as the system prompt, which layout scans."""
    return chat((PROSE * (size // len(PROSE) + 1))[:size])


def user_prose(size: int) -> Messages:
    """Return plain prose as the user message, which layout leaves alone."""
    return chat("Be brief.", (PROSE * (size // len(PROSE) + 1))[:size])


def chat(system: str, user: str = "What does it say?") -> Messages:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


KINDS: dict[str, Callable[[int], Messages]] = {
    "request id + spaces": request_id_and_spaces,
    "chained labels": chained_labels,
    "dates": dates,
    "system prose": system_prose,
    "user prose": user_prose,
}


def forget_scanned_texts() -> None:
    """Make every run scan its text, as a request with a text never seen before does (layout remembers long ones)."""
    layout._FOUND.clear()


async def prepare_once(engine: Engine, messages: Messages) -> tuple[float, float, str]:
    """Prepare one request; return its seconds, the longest event-loop stall meanwhile, and what came of it."""
    stall = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now

    forget_scanned_texts()
    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker runs before preparation starts
    request = PromptRequest(params=SamplingParams(max_tokens=1), messages=messages)
    start = time.perf_counter()
    try:
        prepared = await engine.prepare(request)
        outcome = f"{len(prepared.token_ids)} tokens"
    except ContextLengthError as error:
        outcome = "refused by characters" if "characters" in str(error) else "refused by tokens"
    seconds = time.perf_counter() - start
    done.set()
    await ticker
    return seconds, stall, outcome


def rules_once(messages: Messages) -> float:
    forget_scanned_texts()
    start = time.perf_counter()
    lay_out(canonicalize_messages(messages))
    return time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000], help="in characters")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (median)")
    args = parser.parse_args()
    backend = await asyncio.to_thread(HFBackend.load, "smollm2-135m", compile_steps=False)
    geometry = backend.geometry
    with tempfile.TemporaryDirectory() as folder:
        config = StoreConfig(TierConfig(0), TierConfig(1 << 20), TierConfig(1 << 20))
        store = TieredStore.open(Path(folder), BlockLayout(geometry.block_shape, geometry.dtype), config)
        engine = Engine(backend, store)
        try:
            context = backend.context_length
            print(f"SmolLM2-135M-Instruct's tokenizer, context {context} tokens; median of {args.repeats} runs")
            header = ["input", "characters", "rules", "x", "prepare", "x", "loop stall", "outcome"]
            rows = []
            for kind, build in KINDS.items():
                previous: tuple[float, float] | None = None
                for size in args.sizes:
                    messages = build(size)
                    rules = statistics.median(rules_once(messages) for _ in range(args.repeats))
                    runs = [await prepare_once(engine, messages) for _ in range(args.repeats)]
                    prepare = statistics.median(run[0] for run in runs)
                    stall = max(run[1] for run in runs)
                    growth = ("", "") if previous is None else (ratio(rules, previous[0]), ratio(prepare, previous[1]))
                    rows.append(
                        [
                            kind,
                            f"{size:,}",
                            seconds(rules),
                            growth[0],
                            seconds(prepare),
                            growth[1],
                            seconds(stall),
                            runs[0][2],
                        ]
                    )
                    previous = (rules, prepare)
            widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
            for row in [header, ["-" * w for w in widths], *rows]:
                print(" | ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        finally:
            await engine.close()


def seconds(value: float) -> str:
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def ratio(value: float, before: float) -> str:
    return f"{value / before:.1f}x"


if __name__ == "__main__":
    asyncio.run(main())
