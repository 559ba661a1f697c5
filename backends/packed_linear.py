"""Linear layers whose weights are laid out once for oneDNN's kernels on a CPU.

A bfloat16 matrix product on a CPU goes to oneDNN, which first reorders the weight into the blocked layout its AMX and
AVX-512 kernels read, on every call. Reordered once at load, the same kernels skip that work: measured on SmolLM2 and
2 cores, each projection and MLP product of a decode step (1 to 30 rows) ran 1.7 to 2.5 times as fast and the output
projection 1.6 times; 512-row prompt chunks gain less (1.2 times on the MLP). Products come out equal, or a unit in
the last place apart where a shape makes the kernels sum in another order (as a different batch does), so answers
are bfloat16's as before (benchmarks/quality_bench.py). This is what `torch.compile`'s weight prepacking does for
linear layers, without compiling.

A float32 product goes to MKL instead. On an Intel Xeon most of them ran slower prepacked for oneDNN, so float32 keeps
torch's own path there; on an AMD EPYC (Zen 3, AVX2) MKL's ran slower (the output projection of 8 rows 2.9 times), and
a whole step of SmolLM2 ran 1.3 to 1.4 times as fast prepacked for 1 to 16 decoding streams (1.1 to 1.4 times for
prompts; README, "Benchmarks"), so float32 weights are prepacked on AMD's x86 CPUs. There they go to a small C kernel
of their own (`cpu_linear.c`, built as the attention kernel is, see `cpu_attention.build`) where it builds, and to
oneDNN's layout where it does not: SmolLM2's 211 layers, their weights coming from memory as in a step, took 31.9 ms
for one row against oneDNN's 39.9 (reading the weights once takes 22.5), 57.7 for 16 rows against 74.4, 958 for 512
against 1003 (benchmarks/linear_bench.py).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import subprocess
import weakref
from pathlib import Path

import torch

from prefixgate.backends import cpu_attention

_log = logging.getLogger(__name__)

_ROWS_HINT = 8  # the row count oneDNN lays a weight out for; every other count of rows runs on that layout too
# Every live packed layer by its number: the `prefixgate::packed_linear` operator takes the number, as a compiled step
# cannot take oneDNN's opaque weight as an argument.
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


class PackedLinear(torch.nn.Module):
    """A bias-optional linear layer computed from a weight laid out once: by the C kernel in float32 where it builds,
    by oneDNN otherwise."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        library = _kernel() if weight.dtype == torch.float32 else None
        with torch.no_grad():
            if library is not None:
                # panels: the C kernel's layout, 16 output features a panel (see cpu_linear.c); not a parameter
                self.panels: torch.Tensor | None = torch.empty((self.out_features + 15) // 16 * 16 * self.in_features)
                weight = weight.contiguous()
                library.prefixgate_pack_linear(
                    weight.data_ptr(), self.out_features, self.in_features, self.panels.data_ptr()
                )
            else:
                self.panels = None
                # packed: oneDNN's opaque layout of the [out_features, in_features] weight; not a parameter
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        self.bias = linear.bias
        self.number = next(_NUMBERS)
        _LAYERS[self.number] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x @ weight.T + bias` for `x` of shape `[..., in_features]`."""
        out: torch.Tensor = torch.ops.prefixgate.packed_linear(x, self.number)
        return out


@torch.library.custom_op("prefixgate::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, number: int) -> torch.Tensor:
    layer = _LAYERS[number]
    if layer.panels is None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
        return out
    assert x.dtype == torch.float32, "the C kernel packed this layer's float32 weight"  # it reads x as float32
    rows = x.reshape(-1, layer.in_features).contiguous()
    result = rows.new_empty((rows.shape[0], layer.out_features))
    bias = None if layer.bias is None else layer.bias.detach().contiguous()  # held while the kernel reads it
    kernel = _kernel()
    assert kernel is not None  # it packed the layer
    m, k, n = rows.shape[0], layer.in_features, layer.out_features  # y[m, n] = x[m, k] W^T, as cpu_linear.c names them
    kernel.prefixgate_linear(
        rows.data_ptr(), m, k, layer.panels.data_ptr(), n, None if bias is None else bias.data_ptr(), result.data_ptr()
    )
    return result.reshape(*x.shape[:-1], layer.out_features)


@_packed_linear.register_fake
def _(x: torch.Tensor, number: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[number].out_features))


def prepack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every plain `torch.nn.Linear` of a model on a CPU by a `PackedLinear`, in place, where its dtype is one
    `packs`; return how many were replaced (0 where it does not apply).

    The replaced layers' weights are no longer parameters: fingerprint the model before.
    """
    if not applies(model):
        return 0
    packed: dict[int, PackedLinear] = {}  # a layer used in several places is packed once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:  # not subclasses: quantized layers keep their own
                setattr(parent, name, packed.setdefault(id(child), PackedLinear(child)))
    return len(packed)


def applies(model: torch.nn.Module) -> bool:
    """Say whether `prepack_linear_weights` would pack this model's layers."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and packs(weight.dtype)


def packs(dtype: torch.dtype) -> bool:
    """Say whether linear weights of `dtype` on this CPU are prepacked: bfloat16 where oneDNN computes it, float32 on
    AMD's x86 CPUs (see the module's docstring), nothing where torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and cpu_vendor() == "AuthenticAMD"


@functools.cache
def cpu_vendor() -> str:
    """Return the CPU's vendor as x86 CPUs name it (`GenuineIntel`, `AuthenticAMD`), or "" where Linux does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


_SOURCE = Path(__file__).with_name("cpu_linear.c")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-mavx2", "-mfma")


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    """Build (once per source) and load the float32 kernel; None, said once in the log, where it cannot run (it needs
    what the attention kernel's float32 build needs: Linux on x86 with AVX2 and FMA, and a C compiler)."""
    why = cpu_attention.unavailable(torch.float32)
    if why is None:
        try:
            library = ctypes.CDLL(str(cpu_attention.build((_SOURCE,), _FLAGS)))
        except (OSError, subprocess.CalledProcessError) as error:
            why = f"building it failed ({cpu_attention.first_line(error)})"
        else:
            pointer, size = ctypes.c_void_p, ctypes.c_int64
            library.prefixgate_pack_linear.argtypes = [pointer, size, size, pointer]
            library.prefixgate_linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer]
            _log.info("float32 linear layers run on the C kernel (AVX2 float32)")
            return library
    _log.info("float32 linear layers are prepacked for oneDNN: the C kernel %s", why)
    return None
