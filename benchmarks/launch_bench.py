"""What a served decode step costs the host: prefixgate's step against transformers' own forward, on any device.

Run by hand: `.venv/bin/python benchmarks/launch_bench.py` (about 2.5 minutes on 2 cores); `benchmarks/gpu_check.sh`
runs it on a GPU, with 3 minutes to finish (it took about 2.5 on an H200 whose host was slow to launch kernels). It
loads SmolLM2 as `prefixgate serve` does on this machine (its dtype, device and compile setting; `--compile` to choose),
decodes `--streams` concurrent requests of 48 tokens through the backend, and times the steps in which every stream
decodes (median). Beside each, one decode step of transformers' own forward on the same weights at the same batch (an
unpatched model, its own cache, eager). Then `torch.profiler` over the 8-stream run: per step, the kernel launches (on
CUDA) or operator calls (on a CPU), the time the GPU was busy, and the operators that took the most host time. On a GPU
whose host is slow to launch kernels, the step's rate is the launches', not the GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from batching_bench import MODEL, table
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from prefixgate.backends import HFBackend, SamplingParams, StepRecord, resolve_model

PROMPT = 40  # tokens of each stream's prompt
PARAMS = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def served_step(backend: HFBackend, records: list[StepRecord], streams: int) -> float:
    """Return the median seconds of the steps in which all `streams` requests decode."""
    prompts = [[100 + (i * 31 + j * 7) % 5000 for j in range(PROMPT)] for i in range(streams)]
    records.clear()
    await asyncio.gather(*(_drain(backend.generate(prompt, [], PARAMS)) for prompt in prompts))
    decoding = [r.seconds for r in records if len(r.work) == streams and r.tokens() == streams]
    return statistics.median(decoding)


def forward_step(model: Any, streams: int, device: torch.device, steps: int = 20) -> float:
    """Return the mean seconds of one decode step of transformers' own forward at `streams` rows."""
    ids = torch.randint(100, 5000, (streams, PROMPT), device=device)  # ids: [streams, PROMPT]
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
        last = ids[:, -1:]  # last: [streams, 1]
        for i in range(steps + 3):  # 3 not counted
            if i == 3:
                _synchronize(device)
                started = time.perf_counter()
            last = model(last, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        _synchronize(device)
    return (time.perf_counter() - started) / steps


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args()

    records: list[StepRecord] = []
    compile_steps = {"auto": "auto", "on": True, "off": False}[args.compile]
    backend = await asyncio.to_thread(HFBackend.load, MODEL, on_step=records.append, compile_steps=compile_steps)
    if backend.compiling is not None:
        await asyncio.to_thread(backend.compiling.join)
    device, dtype = backend.device, backend.geometry.dtype
    print(f"SmolLM2-135M-Instruct, {dtype}, {device}, steps {backend.steps}\n")
    await served_step(backend, records, 2)  # warm up
    served = {streams: await served_step(backend, records, streams) for streams in args.streams}

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)  # the steps run on the model's
    with profile(activities=activities, experimental_config=every_thread) as profiled:
        await served_step(backend, records, 8)
    steps = len(records)
    backend.close()

    # transformers' own model only now, on this thread: a second thread computing on a CPU beside the model's makes a
    # second pool of threads, which slows every step of the model's (see prefixgate/threads.py).
    folder = resolve_model(MODEL).folder
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    rows = [
        [str(streams), f"{served[streams] * 1e3:.1f} ms", f"{forward_step(model, streams, device) * 1e3:.1f} ms"]
        for streams in args.streams
    ]
    print("One decode step, the median of those in which every stream decodes:")
    table(["streams", "prefixgate's step", "transformers' forward"], rows)

    averages = profiled.key_averages()
    launches = sum(a.count for a in averages if a.key in LAUNCHES)
    calls = sum(a.count for a in averages if a.key.startswith(("aten::", "prefixgate::")))
    busy = sum(a.self_device_time_total for a in averages) / 1e3 / steps  # µs to ms
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:8]
    summary = {
        "device": str(device),
        "steps": backend.steps,
        "step": rows,
        "launches": launches / steps,
        "operator_calls": calls / steps,
        "gpu_busy_ms": busy,
        "top": [[a.key, a.count / steps, a.self_cpu_time_total / 1e3 / steps] for a in top],
    }
    print(f"8 streams, {steps} steps profiled, per step:")
    table(
        ["kernel launches", "operator calls", "GPU busy"],
        [[f"{launches / steps:.0f}", f"{calls / steps:.0f}", f"{busy:.1f} ms" if launches else "-"]],
    )
    table(
        ["operator", "calls a step", "host ms a step"],
        [[name[:60], f"{count:.0f}", f"{ms:.2f}"] for name, count, ms in summary["top"]],
    )
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
