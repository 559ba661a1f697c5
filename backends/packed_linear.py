"""Linear layers whose weights are laid out once for oneDNN's bfloat16 kernels on a CPU.

A bfloat16 matrix product on a CPU goes to oneDNN, which first reorders the weight into the blocked layout its AMX and
AVX-512 kernels read, on every call. Reordered once at load, the same kernels skip that work: measured on SmolLM2 and
2 cores, each projection and MLP product of a decode step (1 to 30 rows) ran 1.7 to 2.5 times as fast and the output
projection 1.6 times; 512-row prompt chunks gain less (1.2 times on the MLP). Products come out equal, or a unit in
the last place apart where a shape makes the kernels sum in another order (as a different batch does), so answers
are bfloat16's as before (benchmarks/quality_bench.py). In float32 most products ran slower that way, so float32
keeps torch's own path. This is what `torch.compile`'s weight prepacking does for linear layers, without compiling.
"""

from __future__ import annotations

import itertools
import weakref

import torch

_ROWS_HINT = 8  # the row count oneDNN lays a weight out for; every other count of rows runs on that layout too
# Every live packed layer by its number: the `prefixgate::packed_linear` operator takes the number, as a compiled step
# cannot take oneDNN's opaque weight as an argument.
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


class PackedLinear(torch.nn.Module):
    """A bias-optional linear layer computed by oneDNN from a weight it laid out once."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # packed: oneDNN's opaque layout of the [out_features, in_features] weight; not a parameter
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _ROWS_HINT)
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
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    return out


@_packed_linear.register_fake
def _(x: torch.Tensor, number: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[number].out_features))


def prepack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every plain `torch.nn.Linear` of a bfloat16 model on a CPU by a `PackedLinear`, in place; return how
    many were replaced (0 where it does not apply: another device or dtype, or a torch built without oneDNN).

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
    return (
        weight is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )
