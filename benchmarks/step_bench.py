"""Compiled decode steps in the model runner alone, SmolLM2 float32: what a step costs without a server around it.

Run by hand: `.venv/bin/python benchmarks/step_bench.py` (three to six minutes on 2 cores, most of it compiling). It
loads SmolLM2 as a server does on a CPU that prepacks float32 weights (AMD's x86 CPUs), compiles its step, and times
`--steps` decode steps of 1, 8 and 16 streams (`--streams`), each stream 40 tokens in; it prints the median and
fastest step. With `--python-linear` a second copy of the model is compiled whose linear layers reach the same kernel
through an operator written in Python (as every build did before `prefixgate::linear_panels` was C++), and the steps
of the two take turns, so a machine whose speed drifts meets both alike: it adds the second copy's times and the
median of the step-by-step ratio. Where float32 weights are not prepacked, or their kernel does not build (it needs
AVX2, FMA and a C++ compiler), it says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from batching_bench import table

from prefixgate.backends import HFBackend, packed_linear
from prefixgate.backends.model_runner import ModelRunner, StepInput
from prefixgate.backends.packed_linear import PackedLinear

CONTEXT = 40  # tokens each stream holds before its timed steps


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
        out: torch.Tensor = torch.ops.benchmark.linear_in_python(x, self.layer.address, self.layer.out_features)
        return out


def load(python_linear: bool) -> tuple[HFBackend, ModelRunner]:
    """Load SmolLM2 prepacked and compile its step (its linear layers behind a Python operator where asked)."""
    backend = HFBackend.load("smollm2-135m", dtype="float32", compile_steps=False)
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


def new_buffer(runner: ModelRunner) -> torch.Tensor:
    config = runner.config
    head_dim = config.hidden_size // config.num_attention_heads
    # buffer: [layers, 2, kv_heads, capacity, head_dim]
    return torch.zeros(config.num_hidden_layers, 2, config.num_key_value_heads, 512, head_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=80, help="timed steps of each count (after 10 not counted)")
    parser.add_argument("--python-linear", action="store_true", help="also a copy behind a Python operator")
    args = parser.parse_args()
    if not packed_linear.packs(torch.float32) or not packed_linear._kernel():
        print("float32 weights are not prepacked on this CPU (AMD's x86 CPUs only), or the kernel does not build here")
        return
    ways = {"C++ operator": False} | ({"Python operator": True} if args.python_linear else {})
    defined = python_operator() if args.python_linear else None  # noqa: F841  # kept while the copies run
    with torch.inference_mode():
        runners = {name: load(python) for name, python in ways.items()}
        print(f"SmolLM2-135M-Instruct, float32 prepacked, compiled, {torch.get_num_threads()} threads\n")
        rows = []
        for count in args.streams:
            buffers = {name: [new_buffer(runner) for _ in range(count)] for name, (_, runner) in runners.items()}
            for name, (_, runner) in runners.items():
                for buffer in buffers[name]:
                    runner.run([StepInput(list(range(100, 100 + CONTEXT)), buffer, 0)])
            times: dict[str, list[float]] = {name: [] for name in runners}
            for step in range(args.steps + 10):
                order = list(runners.items()) if step % 2 else list(reversed(runners.items()))
                for name, (_, runner) in order:
                    inputs = [StepInput([7 + i], buffer, CONTEXT + step) for i, buffer in enumerate(buffers[name])]
                    start = time.perf_counter()
                    runner.run(inputs)
                    if step >= 10:
                        times[name].append(time.perf_counter() - start)
            row = [str(count)]
            for name in runners:
                row.append(f"{statistics.median(times[name]) * 1e3:.2f} ms ({min(times[name]) * 1e3:.2f})")
            if args.python_linear:
                pairs = zip(times["Python operator"], times["C++ operator"], strict=True)
                row.append(f"{statistics.median(slow / fast for slow, fast in pairs):.3f}x")
            rows.append(row)
        extra = ["Python / C++, step by step"] if args.python_linear else []
        table(["streams", *(f"{name}: median (fastest)" for name in runners), *extra], rows)
        for backend, _ in runners.values():
            backend.close()


if __name__ == "__main__":
    main()
