"""Compiled decode steps in the model runner alone, SmolLM2: what a step costs without a server around it.

Run by hand: `.venv/bin/python benchmarks/step_bench.py` (three to six minutes on 2 cores, most of it compiling). It
loads SmolLM2 as a server does on a CPU that prepacks float32 weights (AMD's x86 CPUs, and others' GGUF codes where the
kernel builds), or in bfloat16 with `--dtype bfloat16` (as a server does by default on a CPU with AVX-512 BF16),
compiles its step, and times `--steps` decode steps of 1, 8 and 16 streams (`--streams`), each stream 40
tokens in; it prints the median and fastest step. With `--python-linear` a second copy of the model is compiled whose
linear layers reach the same kernel through an operator written in Python (as every build did before
`prefixgate::linear_panels` was C++), and the steps of the two take turns, so a machine whose speed drifts meets both
alike: it adds the second copy's times and the median of the step-by-step ratio. With `--prefix N` every stream reads a
shared prefix of N positions first (random K and V, one tensor read in place by all, as a tier lends a cached prefix,
in the kernel's order where a server's store lays its top tier out so: `cpu_attention.KernelOrder`; for the kernel
from DIR below too where it takes that order, in token order where its sources are from before). With `--runs K` that
prefix is lent in K runs of equal length, as a tier lends a prefix it holds in pieces.
With `--attention-against DIR` each step is also timed with the attention kernel built from the sources in DIR
(`cpu_attention.c` and its two headers, say an earlier commit's `backends/`), the two kernels taking turns on the same
model: it adds that column and the median of the step-by-step ratio.
With `--prompt N` each timed step is N new tokens of every stream instead of one (warm questions after the prefix
prefilled in one step, as arrivals together are), at the same positions every step.
With `--profile` it also prints where a step's time goes: `torch.profiler` over 20 more steps of each count, the
operators that took the most of it. Where float32 weights are not prepacked, or their kernel does not build (it needs
AVX2, FMA and a C++ compiler), it says so and stops."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from batching_bench import table
from torch.profiler import ProfilerActivity, profile

from prefixgate.backends import HFBackend, cpu_attention, packed_linear
from prefixgate.backends.model_runner import ModelRunner, StepInput
from prefixgate.backends.packed_linear import PackedLinear

CONTEXT = 40  # tokens each stream holds before its timed steps
POSITIONS = 512  # what each stream's own buffer holds
PROFILED = 20  # steps of each count `--profile` records


def python_operator() -> torch.library.Library:
    """Define `benchmark::linear_in_python`: the kernel's operator called from an operator written in Python; return
    its library, which must be kept (the definition lives as long as it)."""
    library = torch.library.Library("benchmark", "DEF")  # type: ignore[no-untyped-call]
    library.define("linear_in_python(Tensor x, int weight, int out_features) -> Tensor")  # type: ignore[no-untyped-call]

    def linear(x: torch.Tensor, weight: int, out_features: int) -> torch.Tensor:
        out: torch.Tensor = torch.ops.prefixgate.linear_panels(x, weight, out_features)
        return out

    library.impl("linear_in_python", linear, "CPU")  # type: ignore[no-untyped-call]
    torch.library.register_fake("benchmark::linear_in_python")(  # type: ignore[untyped-decorator]
        lambda x, weight, out_features: x.new_empty((*x.shape[:-1], out_features))
    )
    return library


class PythonLinear(torch.nn.Module):
    """A packed layer whose forward calls `benchmark::linear_in_python` instead of the kernel's operator."""

    def __init__(self, layer: PackedLinear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.benchmark.linear_in_python(x, self.layer.number, self.layer.out_features)
        return out


def load(dtype: str, python_linear: bool) -> tuple[HFBackend, ModelRunner]:
    """Load SmolLM2 prepacked and compile its step (its linear layers behind a Python operator where asked)."""
    backend = HFBackend.load("smollm2-135m", dtype=dtype, compile_steps=False)
    runner = backend._runner
    if python_linear:
        for parent in list(runner.model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, PackedLinear):
                    setattr(parent, name, PythonLinear(child))
    buffers = [new_buffer(runner) for _ in range(2)]
    runner.compile(
        [[StepInput([1], buffers[0], 0)], [StepInput([1, 2, 3], buffers[0], 0), StepInput([4], buffers[1], 0)]]
    )
    return backend, runner


def new_buffer(
    runner: ModelRunner, positions: int = POSITIONS, fill: Callable[..., torch.Tensor] = torch.zeros
) -> torch.Tensor:
    config = runner.config
    head_dim = config.hidden_size // config.num_attention_heads
    # buffer: [layers, 2, kv_heads, positions, head_dim]
    buffer = fill(config.num_hidden_layers, 2, config.num_key_value_heads, positions, head_dim)
    return buffer.to(runner.model.dtype)


def reads_tiles(kernels: cpu_attention.Kernels) -> bool:
    """Say whether a build of the kernel reads a shared prefix in `cpu_attention.KernelOrder`."""
    takes = getattr(kernels.few, "prefixgate_takes_tiles", None)  # none in sources from before that order
    return takes is not None and takes() == 1


def step_inputs(
    buffers: list[torch.Tensor], at: int, shared: tuple[torch.Tensor, ...], prompt: int = 0
) -> list[StepInput]:
    """Return decode step `at` of one stream a buffer, after the shared prefix (if any) and `CONTEXT` tokens of each;
    with `prompt`, that many new tokens of each instead, at the same positions every step."""
    held = sum(run.shape[3] for run in shared)
    if prompt:
        tokens = [list(range(7 + i, 7 + i + prompt)) for i in range(len(buffers))]
        return [StepInput(ids, kv, held + CONTEXT, held, shared) for ids, kv in zip(tokens, buffers, strict=True)]
    return [StepInput([7 + i], kv, held + CONTEXT + at, held, shared) for i, kv in enumerate(buffers)]


def profiled(
    runner: ModelRunner, buffers: list[torch.Tensor], after: int, shared: tuple[torch.Tensor, ...], prompt: int
) -> list[list[str]]:
    """Run `PROFILED` decode steps from step `after` under `torch.profiler`; return rows of the operators that took the
    most time of them, by their own time (not counting the operators they called): milliseconds and calls a step."""
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        for at in range(after, after + PROFILED):
            runner.run(step_inputs(buffers, at, shared, prompt))
    events = sorted(recorded.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)
    return [
        [event.key[:60], f"{event.self_cpu_time_total / PROFILED / 1e3:.2f} ms", f"{event.count / PROFILED:g}"]
        for event in events[:6]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=80, help="timed steps of each count (after 10 not counted)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    parser.add_argument("--python-linear", action="store_true", help="also a copy behind a Python operator (float32)")
    parser.add_argument("--attention-against", type=Path, metavar="DIR", help="also the attention kernel from DIR")
    parser.add_argument("--prefix", type=int, default=0, help="positions of a shared prefix every stream reads first")
    parser.add_argument("--runs", type=int, default=1, help="the prefix lent in this many runs of equal length")
    parser.add_argument("--profile", action="store_true", help="also where a step's time goes, by operator")
    parser.add_argument("--prompt", type=int, default=0, help="each step N new tokens of every stream, not one")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.python_linear and dtype != torch.float32:
        parser.error("--python-linear times float32's kernel: leave out --dtype bfloat16")
    if not 0 <= args.prompt <= POSITIONS - CONTEXT:
        parser.error(f"--prompt takes 0 to {POSITIONS - CONTEXT} tokens")
    most = POSITIONS - CONTEXT - 10 - PROFILED  # decode steps go on past the 10 not counted and the profiled ones
    if args.steps < 1 or (args.steps > most and not args.prompt):
        parser.error(f"--steps takes 1 to {most} decode steps: each stream's buffer holds {POSITIONS} positions")
    if args.runs < 1 or args.prefix % args.runs:
        parser.error("--runs takes a count that divides --prefix")
    if not packed_linear.packs(dtype) or (dtype == torch.float32 and not packed_linear._kernel()):
        print(f"{args.dtype} weights are not prepacked on this CPU, or the kernel does not build here")
        return
    if args.attention_against and not cpu_attention.prepare(dtype):
        print(f"the attention kernel does not run in {args.dtype} here: {cpu_attention.unavailable(dtype)}")
        return
    against = None
    if args.attention_against:  # built before the model loads, so that a wrong DIR is said at once
        sources = tuple(args.attention_against / source.name for source in cpu_attention._SOURCES)
        against, said = cpu_attention.kernels_from(dtype, sources)
        if against is None:
            raise SystemExit(f"the attention kernel in {args.attention_against}: {said}")
    # each way a step is run: a model, and the attention kernel it runs with (None: this checkout's)
    models = {"this build": False} | ({"Python operator": True} if args.python_linear else {})
    defined = python_operator() if args.python_linear else None  # noqa: F841  # kept while the copies run
    with torch.inference_mode():
        loaded = {name: load(args.dtype, python) for name, python in models.items()}
        ways = {name: (runner, None) for name, (_, runner) in loaded.items()}
        if against:
            ways["attention from DIR"] = (loaded["this build"][1], against)
        print(f"SmolLM2-135M-Instruct, {args.dtype} prepacked, compiled, {torch.get_num_threads()} threads")
        said = [f"each stream on a shared prefix of {args.prefix} positions"] if args.prefix else []
        said += [f"lent in {args.runs} runs"] if args.prefix and args.runs > 1 else []
        said += [f"each step {args.prompt} new tokens of every stream"] if args.prompt else []
        print("".join(f"{line}\n" for line in said))
        first, p = ways["this build"][0], args.prefix
        # Lent in the order a server's store lays its top tier out in for this build; for the kernel from DIR too
        # where it reads that order (sources from before it read tokens' order).
        length = p // args.runs
        tiled = loaded["this build"][0].slot_order is not None and length % 32 == 0
        whole = new_buffer(first, p, torch.randn)  # the same random K and V for every copy
        shared = tuple(whole[:, :, :, at : at + length] for at in range(0, p, length)) if p else ()
        ours = cpu_attention._library
        rows, profiles = [], []
        for count in args.streams:
            buffers = {name: [new_buffer(runner) for _ in range(count)] for name, (runner, _) in ways.items()}
            for name, (runner, _) in ways.items():
                for buffer in buffers[name]:
                    runner.run([StepInput(list(range(100, 100 + CONTEXT)), buffer, p, p, shared)])
            times: dict[str, list[float]] = {name: [] for name in ways}
            for at in range(args.steps + 10):
                for name in ways if at % 2 else reversed(ways):
                    runner, kernels = ways[name]
                    # the kernel a step is laid out with (`cpu_attention.StepLayout` asks `_library` each step)
                    cpu_attention._library = ours if kernels is None else (lambda _dtype, k=kernels: k)
                    runner.shared_tiled = tiled and (kernels is None or reads_tiles(kernels))
                    inputs = step_inputs(buffers[name], at, shared, args.prompt)  # made before the clock, as the step's
                    start = time.perf_counter()
                    runner.run(inputs)
                    if at >= 10:
                        times[name].append(time.perf_counter() - start)
            cpu_attention._library = ours
            if args.profile:
                for name, (runner, kernels) in ways.items():
                    if kernels is None:
                        top = profiled(runner, buffers[name], args.steps + 10, shared, args.prompt)
                        profiles += [[str(count), name, *row] for row in top]
            row = [str(count)]
            for name in ways:
                row.append(f"{statistics.median(times[name]) * 1e3:.2f} ms ({min(times[name]) * 1e3:.2f})")
            for other in ways:
                if other != "this build":
                    pairs = zip(times[other], times["this build"], strict=True)
                    row.append(f"{statistics.median(theirs / mine for theirs, mine in pairs):.3f}x")
            rows.append(row)
        ratios = [f"{other} / this build, step by step" for other in ways if other != "this build"]
        table(["streams", *(f"{name}: median (fastest)" for name in ways), *ratios], rows)
        if profiles:
            print(f"Where {PROFILED} more steps' time went, by operator (its own time, not its callees'):")
            table(["streams", "linear layers", "operator", "a step", "calls a step"], profiles)
        for backend, _ in loaded.values():
            backend.close()


if __name__ == "__main__":
    main()
