"""How fast a step runs: this build as it serves by default, with its steps eager, in float32, and llama.cpp's server
on the same weights.

Run by hand: `.venv/bin/python benchmarks/speed_bench.py --llama-server PATH --gguf F32.gguf --gguf BF16.gguf`
(about seven minutes; without `--llama-server` only prefixgate's rows). Every server runs at once, through HTTP on
127.0.0.1 (prefixgate with its store in memory, measured once its steps are compiled; llama.cpp's server with 8
slots, each with room for the whole prompt, its other settings as they come), and in each of 5 rounds each is
measured in turn while the others idle, so that the machine's drift meets them alike. It prints the medians of:

- decode tokens/s of 1 stream and of 8 streams at once (64 tokens each, greedy, a short prompt, counted while all of
  them decode);
- the first token of a warm request: a new question after a 4k-token system prompt sent once before, which
  prefixgate serves from its cache and llama.cpp's server from a slot that kept the prompt.

The GGUF files are the model folder converted with llama.cpp's `convert_hf_to_gguf.py --outtype f32` (and `bf16`).
`--against PATH` also serves another build's `prefixgate` executable by default, in the same rounds (repeat it): on a
machine whose speed drifts within the hour, two builds measured in turn compare where two runs one after the other
do not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
from pathlib import Path

from batching_bench import Served, launched, own_prefixgate, served, table
from sharing_bench import decode_rate, first_tokens, system_prompt

PREFIX_TOKENS = 4096
STREAMS = 8
ROUNDS = 5


async def prime(url: str, system: str) -> None:
    """Warm a server up and put the prompt in its cache (or a slot)."""
    await decode_rate(url, None, 2, 0)
    await first_tokens(url, system, 1, 1000, warm=False)


async def measure(url: str, system: str, round_: int, *, warm: bool) -> tuple[float, float, float]:
    """Return one round's decode tokens/s of 1 and of 8 streams, and the first token of a warm request after
    `system`."""
    one = await decode_rate(url, None, 1, 10 + round_)
    many = await decode_rate(url, None, STREAMS, 100 + STREAMS * round_)
    ttft = (await first_tokens(url, system, 1, 2000 + round_, warm=warm))[0]
    return one, many, ttft


def llama_server(executable: str, gguf: str) -> contextlib.AbstractAsyncContextManager[Served]:
    """Run llama.cpp's server on `gguf` with a slot per stream, each with room for the whole prompt."""
    context = STREAMS * (PREFIX_TOKENS + 1024)
    return launched(
        lambda port: (
            [executable, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
            + ["-np", str(STREAMS), "-c", str(context)]
        )
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixgate", default=own_prefixgate())
    parser.add_argument("--llama-server", help="llama.cpp's llama-server executable")
    parser.add_argument("--gguf", action="append", default=[], help="a model file for llama-server (repeat it)")
    parser.add_argument("--against", action="append", default=[], help="another build's prefixgate, served by default")
    args = parser.parse_args()
    import torch

    print(f"SmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {os.cpu_count()} cores\n")
    system = system_prompt(PREFIX_TOKENS)
    servers: list[tuple[str, contextlib.AbstractAsyncContextManager[Served], bool]] = [
        ("prefixgate (default)", served(args.prefixgate), True),
        ("prefixgate --compile off", served(args.prefixgate, "--compile", "off"), True),
        ("prefixgate --dtype float32", served(args.prefixgate, "--dtype", "float32"), True),
    ]
    servers += [(f"{other} (default)", served(other), True) for other in args.against]
    if args.llama_server:
        servers += [(f"llama.cpp {Path(g).name}", llama_server(args.llama_server, g), False) for g in args.gguf]
    async with contextlib.AsyncExitStack() as stack:
        running = [(name, await stack.enter_async_context(context), warm) for name, context, warm in servers]
        for _, server, _ in running:
            await prime(server.url, system)
        # Every server measured in each round, in turn, so that the machine's drift meets them alike.
        rounds: list[list[tuple[float, float, float]]] = [[] for _ in running]
        for round_ in range(ROUNDS):
            for measured, (_, server, warm) in zip(rounds, running, strict=True):
                measured.append(await measure(server.url, system, round_, warm=warm))
    results = [
        (name, *(statistics.median(values) for values in zip(*measured, strict=True)))
        for (name, _, _), measured in zip(servers, rounds, strict=True)
    ]
    # The peer's first model file (F32) is what the targets compare with, when it ran.
    base = next((r for r in results if r[0].startswith("llama.cpp")), None)
    rows = []
    for name, one, many, ttft in results:
        against = ["", ""] if base is None else [f"{one / base[1]:.2f}x", f"{many / base[2]:.2f}x"]
        rows.append([name, f"{one:.1f}", f"{many:.1f}", *against, f"{ttft * 1e3:.0f} ms"])
    header = ["server", "1 stream", f"{STREAMS} streams", "1 vs llama.cpp", f"{STREAMS} vs llama.cpp"]
    print(f"Decode tokens/s, and the first token of a warm request after a {PREFIX_TOKENS}-token prompt:")
    table([*header, "warm first token"], rows)


if __name__ == "__main__":
    asyncio.run(main())
