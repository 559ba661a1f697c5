"""Compiling the step under traffic: how long the background compile takes while clients keep the model busy, and what
the streams get meanwhile and after.

Run by hand: `.venv/bin/python benchmarks/compile_bench.py` (up to `--minutes`, 10 by default). It loads SmolLM2 as a
server does by default (bfloat16 where the CPU has AVX-512 BF16, the step compiling in a thread of its own), with a
fresh compile cache in a temporary folder, and from the start runs `--clients` clients in the same process, each asking
one short chat (`--tokens` tokens) after another through the engine, until the step has been compiled for `--after`
seconds or `--minutes` have passed. It prints when the step was compiled (or that it was not), the tokens/s of all
clients while it compiled and after, and the longest and 99th-percentile gap between a stream's tokens. `--nice N`
runs the compiling thread at nice N instead of the 19 it is built with, to weigh the trade-off. Where the step is not
compiled by default (nothing prepacked), it says so and stops. A run that ends while the step still compiles may abort
on its way out ("terminate called without an active exception"), after its table.

With `--restarts N` it times starts instead, without traffic: N processes one after another, each loading SmolLM2 as a
server does and waiting for its step to be compiled (as `prefixgate serve --compile-wait` does), all with one compile
cache in a temporary folder, empty for the first. It prints each start's seconds to the model loaded and to the step
compiled (from the process's first line, its imports included) and how many of the step's two graphs came from torch's
compile cache.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batching_bench import table

from prefixgate.backends import HFBackend, SamplingParams
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.store import BlockLayout, StoreConfig, TierConfig, TieredStore

MODEL = "smollm2-135m"
BUILT_NICE = 19  # what the compiling thread sets itself to
# One start (`--restarts`): load the model, wait for the step to compile, print the seconds of each and the graphs taken
# from the compile cache.
START = f"""
import time
started = time.perf_counter()
from torch._dynamo.utils import counters
from prefixgate.backends import HFBackend
backend = HFBackend.load({MODEL!r})
loaded = time.perf_counter()
backend.wait_compiled()
print(loaded - started, time.perf_counter() - started, backend.steps, counters["inductor"]["fxgraph_cache_hit"])
backend.close()
"""


def at_nice(nice: int) -> None:
    """Have the compiling thread set itself to `nice` instead of BUILT_NICE."""
    set_priority = os.setpriority

    def replaced(which: int, who: int, priority: int) -> None:
        set_priority(which, who, nice if priority == BUILT_NICE else priority)

    os.setpriority = replaced


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24, help="tokens of each answer")
    parser.add_argument("--minutes", type=float, default=10, help="the longest the clients run")
    parser.add_argument("--after", type=float, default=90, help="seconds the clients run once the step is compiled")
    parser.add_argument("--nice", type=int, default=BUILT_NICE, help="the compiling thread's nice value")
    parser.add_argument("--restarts", type=int, default=0, help="time N starts on one compile cache instead")
    args = parser.parse_args()
    if args.restarts:
        restarts(args.restarts)
        return
    if args.nice != BUILT_NICE:
        at_nice(args.nice)
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(folder) / "inductor")  # compiled from nothing
        backend = await asyncio.to_thread(HFBackend.load, MODEL)
        compiling = backend.compiling
        if compiling is None:
            print(f"the step is not compiled by default here (steps: {backend.steps}); nothing to measure")
            return
        geometry = backend.geometry
        layout = BlockLayout(geometry.block_shape, geometry.dtype)
        tiers = StoreConfig(TierConfig(0), TierConfig(1 << 28), TierConfig(1 << 28))  # the host tier and the disk
        store = TieredStore.open(Path(folder) / "store", layout, tiers)
        engine = Engine(backend, store)
        started = time.perf_counter()
        compiled_at: float | None = None
        stamps: list[float] = []
        gaps: list[float] = []

        def running() -> bool:
            nonlocal compiled_at
            now = time.perf_counter()
            if compiled_at is None and not compiling.is_alive():
                compiled_at = now
            return now - started < args.minutes * 60 and (compiled_at is None or now - compiled_at < args.after)

        async def client(index: int) -> None:
            asked = 0
            while running():
                messages = [{"role": "user", "content": f"Tell me about the number {index * 1000 + asked}."}]
                params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
                generation = await engine.generate(PromptRequest(params, messages=messages))
                last = time.perf_counter()
                async with generation:
                    async for _ in generation:
                        now = time.perf_counter()
                        gaps.append(now - last)
                        stamps.append(now)
                        last = now
                asked += 1

        try:
            await asyncio.gather(*(client(index) for index in range(args.clients)))
        finally:
            await engine.close()
    ended = time.perf_counter()
    until = compiled_at or ended
    during = sum(stamp < until for stamp in stamps) / (until - started)
    after = f"{sum(stamp >= until for stamp in stamps) / (ended - until):.1f}" if compiled_at else "-"
    gaps.sort()
    compiled = f"{compiled_at - started:.0f} s" if compiled_at else f"not in {ended - started:.0f} s"
    table(
        ["nice", "clients", "compiled after", "tokens/s while compiling", "tokens/s after", "slowest gap", "99th pct"],
        [
            [
                str(args.nice),
                str(args.clients),
                compiled,
                f"{during:.1f}",
                after,
                f"{gaps[-1] * 1e3:.0f} ms",
                f"{gaps[int(len(gaps) * 0.99)] * 1e3:.0f} ms",
            ]
        ],
    )


def restarts(count: int) -> None:
    """Time `count` starts one after another on one compile cache, empty for the first (see `START`)."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        environment = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(Path(folder) / "inductor")}
        for start in range(1, count + 1):
            run = subprocess.run(
                [sys.executable, "-c", START], env=environment, capture_output=True, text=True, check=False
            )
            if run.returncode != 0:
                raise SystemExit(f"start {start} failed:\n{run.stderr[-2000:]}")
            loaded, compiled, steps, hits = run.stdout.split()[-4:]
            if steps != "compiled":
                print(f"the step is not compiled by default here (steps: {steps}); nothing to measure")
                return
            rows.append([str(start), f"{float(loaded):.1f} s", f"{float(compiled):.1f} s", f"{hits} of 2"])
    table(["start", "model loaded", "step compiled", "graphs from the compile cache"], rows)


if __name__ == "__main__":
    asyncio.run(main())
