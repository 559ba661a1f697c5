"""A step's linear layers, alone: SmolLM2's 211 layers on the C++ kernel's layouts against oneDNN's (and MKL's).

Run by hand: `.venv/bin/python benchmarks/linear_bench.py` (about a minute). SmolLM2's linear layers in float32 (its 30
layers' projections and MLPs, and the output projection), each packed three ways and as torch holds them, are run one
after another on random rows, as a step runs them: the weights come from memory each time. The ways: the C++ kernel's
code panels (the weights are the embedded GGUF's Q4_1 and Q8_0 blocks, held as their codes and rebuilt exactly as they
are read, 115 MB; `backends/cpu_linear.cpp`), its float panels (540 MB), both the kernel alone at every row count,
oneDNN's layout as `packed_linear` makes it where the kernel does not build, and torch's own product (MKL's, which a
served layer on Intel's CPUs takes past 64 rows). It prints the median time of all 211 for each row count, the four
taking turns, and what reading the float weights once takes (a sum over a tensor of their size). Where the kernel does
not build (it needs AVX2, FMA and a C++ compiler), it says so and stops.

Where the kernel takes bfloat16 (AVX-512 BF16), a second table: the same layers in bfloat16 as a server packs them (the
kernel's code panels, read from the float32 weights in the model's folder, for up to 5 rows, its pair panels past them
up to `pair_rows()` rows, oneDNN's layout past those, called from C++; where the CPU has AMX, the codes for up to 512
rows, 2 or more on its tiles), as it packs a bfloat16 layer that is not codes (pair panels for up to `pair_rows()`
rows, oneDNN's past them: 8 rows with AMX, 64 on AVX-512 BF16's dot products, every count where the kernel's products
run on FMAs), and oneDNN's layout alone through the Python operator (`prefixgate::packed_linear`, as layers where the
kernel does not take bfloat16 run), and what reading the bfloat16 weights once takes.

With `--against DIR` it prints one table instead: the kernel built from DIR/cpu_linear.cpp (say an earlier commit's
`backends/`, whose weight layout is this one's and whose operator takes a layer by its number) beside this build's, both
on the same layers packed as a server packs them (in bfloat16 where the kernel takes it, else float32), taking turns
layer pass by layer pass, so that a machine whose speed drifts meets both alike: each one's median, the median of the
pass-by-pass ratio with its lowest and highest, and whether the two gave the same bits. `--rows` chooses the row counts.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from batching_bench import in_turn, table

from prefixgate.backends import HFBackend, cpu_attention, packed_linear
from prefixgate.backends.packed_linear import PackedLinear

ROWS = [1, 8, 16, 64, 512]
BFLOAT16_ROWS = [1, 4, 6, 8, 16, 32, 64, 216, 512]
ROUNDS = 5
Operator = Callable[..., torch.Tensor]  # `prefixgate::linear_panels`, or the same operator of another build


def median_ms(runs: list[Callable[[], object]]) -> list[float]:
    """Run each in turn ROUNDS times (`in_turn`: the first of a round measured up to a tenth slower than the same
    layers later in it); return each one's median in ms."""
    return [statistics.median(t) * 1e3 for t in in_turn(runs, ROUNDS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, metavar="DIR", help="this build beside the kernel in DIR")
    parser.add_argument("--rows", type=int, nargs="+", help="the row counts (with --against: 1 8 16 32 64)")
    args = parser.parse_args()
    if not packed_linear._kernel():
        print("the float32 linear kernel does not build here (it needs AVX2, FMA and a C++ compiler); see the log")
        return
    if args.against:
        against(args.against, args.rows or [1, 8, 16, 32, 64])
        return
    backend = HFBackend.load("smollm2-135m", dtype="float32", prepack_weights=False, compile_steps=False)
    plain = [m for m in backend._runner.model.modules() if type(m) is torch.nn.Linear]
    codes = [PackedLinear(linear) for linear in plain]
    floats = [PackedLinear(linear, codes=False) for linear in plain]
    for layer in codes + floats:
        layer.plain = None  # the kernel alone, for every row count (served, Intel's CPUs give past 64 rows to MKL)
    real = packed_linear._kernel
    packed_linear._kernel = lambda: False  # type: ignore[assignment]  # packs for oneDNN
    try:
        onednn = [PackedLinear(linear) for linear in plain]
    finally:
        packed_linear._kernel = real
    weights = torch.ones(sum(linear.weight.numel() for linear in plain))  # written, so its pages are its own
    print(
        f"SmolLM2-135M-Instruct's {len(plain)} linear layers, float32, {torch.get_num_threads()} threads; "
        f"{weights.numel() * 4 / 1e6:.0f} MB of float weights; {sum('codes' in layer.layout for layer in codes)} "
        f"layers held as codes, {sum(part.nbytes for layer in codes for part in layer.layout.values()) / 1e6:.0f} MB; "
        f"the median of {ROUNDS} rounds\n"
    )
    rows = []
    with torch.inference_mode():
        (reading,) = median_ms([weights.sum])
        for count in args.rows or ROWS:
            inputs = {n: torch.randn(count, n) for n in {linear.in_features for linear in plain}}

            def run(layers: list[torch.nn.Module], inputs: dict[int, torch.Tensor] = inputs) -> None:
                for layer in layers:
                    layer(inputs[layer.in_features])

            times = median_ms([lambda: run(codes), lambda: run(floats), lambda: run(onednn), lambda: run(plain)])
            rows.append([str(count), *(f"{ms:.1f} ms" for ms in times), f"{reading:.1f} ms"])
    columns = ["rows", "C++ kernel, codes", "C++ kernel, floats", "oneDNN's layout", "torch's own (MKL)"]
    table([*columns, "reading the float weights"], rows)
    backend.close()
    if packed_linear.bfloat16_products():
        bfloat16(args.rows or BFLOAT16_ROWS)


def bfloat16(counts: list[int]) -> None:
    """Print the bfloat16 table: the layers as served (the kernel's code panels up to 5 rows, its pair panels up to 64,
    oneDNN's layout past them; with AMX, the codes up to 512 rows), with pair panels alone (up to 64 rows, 8 with AMX,
    oneDNN's past them), and oneDNN's layout alone."""
    backend = HFBackend.load("smollm2-135m", dtype="bfloat16", prepack_weights=False, compile_steps=False)
    model = backend._runner.model
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    sources = packed_linear._float32_sources(model)  # the float32 weights in the model's folder, GGUF's blocks
    # made in turn, layer by layer: layers made first ran up to 6% slower than the same layers made later
    codes: list[PackedLinear] = []
    pairs: list[PackedLinear] = []
    for linear in plain:
        codes.append(PackedLinear(linear, found=packed_linear._original_codes(sources.get(id(linear.weight)))))
        pairs.append(PackedLinear(linear))
    onednn = [PackedLinear(linear, pairs=False) for linear in plain]
    weights = torch.ones(sum(linear.weight.numel() for linear in plain) // 2)  # the bfloat16 weights' bytes
    held = sum(part.nbytes for layer in codes for part in layer.layout.values())
    print(
        f"\nThe same {len(plain)} layers in bfloat16, {weights.nbytes / 1e6:.0f} MB; "
        f"{sum('codes' in layer.layout for layer in codes)} also as codes for the kernel, {held / 1e6:.0f} MB with "
        f"{'nothing else (AMX)' if packed_linear.amx_products() else 'its pair panels'}; "
        f"the median of {ROUNDS} rounds\n"
    )
    rows = []
    with torch.inference_mode():
        (reading,) = median_ms([weights.sum])
        for count in counts:
            inputs = {n: torch.randn(count, n, dtype=torch.bfloat16) for n in {linear.in_features for linear in plain}}

            def run(layers: list[PackedLinear], inputs: dict[int, torch.Tensor] = inputs) -> None:
                for layer in layers:
                    layer(inputs[layer.in_features])

            times = median_ms([lambda: run(codes), lambda: run(pairs), lambda: run(onednn)])
            rows.append([str(count), *(f"{ms:.1f} ms" for ms in times), f"{reading:.1f} ms"])
    most = packed_linear.pair_rows()
    pairs_to = "past" if most is None else f"to {most}, oneDNN past"
    columns = [
        "rows",
        "as served: codes to 512 rows (AMX's tiles from 2), oneDNN past"
        if packed_linear.amx_products()
        else f"as served: codes to 5 rows, pairs {pairs_to}",
        "pairs alone" if most is None else f"pairs alone: to {most} rows, oneDNN past",
        "oneDNN's layout (Python operator)",
    ]
    table([*columns, "reading the weights"], rows)
    backend.close()


def other_kernel(directory: Path) -> Operator:
    """Build the kernel in `directory` (its cpu_linear.cpp) with this build's flags, as an operator of its own
    namespace so that it loads beside this one, and return that operator."""
    path = directory / packed_linear._SOURCE.name
    if not path.is_file():
        raise SystemExit(f"no {path.name} in {directory}: give a folder holding one, such as a checkout's backends/")
    source = path.read_text()
    for macro in ("TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        source = source.replace(f"{macro}(prefixgate,", f"{macro}(prefixgate_against,")
    compiler = cpu_attention.cxx_compiler()
    assert compiler is not None  # this build's kernel built
    with tempfile.TemporaryDirectory() as folder:
        renamed = Path(folder) / packed_linear._SOURCE.name
        renamed.write_text(source)
        try:
            built = cpu_attention.build_operator(renamed, packed_linear._built[0], compiler)
        except subprocess.CalledProcessError as error:
            raise SystemExit(f"{path} did not build: {cpu_attention.first_line(error)}") from None
    torch.ops.load_library(built)  # type: ignore[no-untyped-call]
    operator: Operator = torch.ops.prefixgate_against.linear_panels
    return operator


def against(directory: Path, counts: list[int]) -> None:
    """Print SmolLM2's layers as a server packs them on this build's kernel and on the one in `directory`, in turn."""
    ours, other = torch.ops.prefixgate.linear_panels, other_kernel(directory)
    dtype = "bfloat16" if packed_linear.bfloat16_products() else "float32"
    backend = HFBackend.load("smollm2-135m", dtype=dtype, prepack_weights=False, compile_steps=False)
    model = backend._runner.model
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    sources = packed_linear._float32_sources(model)
    codes = [packed_linear._original_codes(sources.get(id(linear.weight))) for linear in plain]
    packed = [packed_linear._pack(linear, original=found) for linear, found in zip(plain, codes, strict=True)]
    # those the kernel takes
    layers = [layer for layer in packed if layer is not None and layer.description is not None]
    for layer in layers:  # described to the other build's operator too, by the same numbers
        torch.ops.prefixgate_against.linear_describe(layer.number, layer.description)
    print(
        f"SmolLM2-135M-Instruct's {len(layers)} linear layers the kernel takes (of {len(plain)}) in {dtype}, as a "
        f"server packs them, {torch.get_num_threads()} threads: this build against the kernel in {directory}, in turn\n"
    )
    rows = []
    with torch.inference_mode():
        for count in counts:
            inputs = {n: torch.randn(count, n, dtype=model.dtype) for n in {layer.in_features for layer in layers}}

            # each operator called alike, with nothing between: a module's call costs a few microseconds a layer
            def run(operator: Operator, inputs: dict[int, torch.Tensor] = inputs) -> list[torch.Tensor]:
                return [
                    operator(inputs[layer.in_features], layer.number, layer.out_features, layer.plain, layer.bias)
                    for layer in layers
                ]

            mine, theirs = (functools.partial(run, operator) for operator in (ours, other))
            same = all(torch.equal(a, b) for a, b in zip(mine(), theirs(), strict=True))
            this, that = in_turn([mine, theirs], 4 * ROUNDS)
            ratios = sorted(t / m for t, m in zip(that, this, strict=True))
            rows.append(
                [
                    str(count),
                    f"{statistics.median(this) * 1e3:.1f} ms",
                    f"{statistics.median(that) * 1e3:.1f} ms",
                    f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}x to {ratios[-1]:.3f}x)",
                    "yes" if same else "no",
                ]
            )
    table(["rows", "this build", "the kernel in DIR", "DIR / this build, pass by pass", "same bits"], rows)
    backend.close()


if __name__ == "__main__":
    main()
