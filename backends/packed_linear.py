"""Linear layers whose weights are laid out once on a CPU: for oneDNN's kernels, or for a kernel of our own.

A bfloat16 matrix product on a CPU goes to oneDNN, which first reorders the weight into the blocked layout its AMX and
AVX-512 kernels read, on every call. Reordered once at load, the same kernels skip that work: measured on SmolLM2 and
2 cores, each projection and MLP product of a decode step (1 to 30 rows) ran 1.7 to 2.5 times as fast and the output
projection 1.6 times; 512-row prompt chunks gain less (1.2 times on the MLP). Products come out equal, or a unit in
the last place apart where a shape makes the kernels sum in another order (as a different batch does), so answers
are bfloat16's as before (benchmarks/quality_bench.py). This is what `torch.compile`'s weight prepacking does for
linear layers, without compiling.

A float32 product goes to MKL instead. On an Intel Xeon most of them ran slower prepacked for oneDNN, so float32 keeps
torch's own path there for prompts; on an AMD EPYC (Zen 3, AVX2) MKL's ran slower (the output projection of 8 rows 2.9
times), and a whole step of SmolLM2 ran 1.3 to 1.4 times as fast prepacked for 1 to 16 decoding streams (1.1 to 1.4
times for prompts; README, "Benchmarks"), so float32 weights are prepacked for every product on AMD's x86 CPUs. There
they go to a small kernel of their own where it builds, and to oneDNN's layout where it does not: SmolLM2's 211 layers,
their weights coming from memory as in a step, took 31.9 ms for one row against oneDNN's 39.9 (reading the weights once
takes 22.5), 57.7 for 16 rows against 74.4, 958 for 512 against 1003 (benchmarks/linear_bench.py). The kernel
(`cpu_linear.cpp`, built as the attention kernel is, see `cpu_attention.build`) is a torch operator of C++,
`prefixgate::linear_panels`, so a compiled step, C++ itself on a CPU, calls it with no Python between: through a Python
operator, a step of one stream of SmolLM2 took 1.13 to 1.17 times as long, of 16 streams 1.05 to 1.09 times
(benchmarks/step_bench.py).

A float32 weight that is exactly GGUF blocks (a GGUF model's Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weights as transformers
loads them, each 32 values along a row d q + o, d a half-precision number and q a small integer; `block_codes`) goes
to the kernel as its codes, two to a byte where they are 0 to 15 (as Q4_1's are) and int8 otherwise, with each
block's d and o: 0.75 or 1.25 bytes a weight instead of 4. The kernel rebuilds each piece of the weight to the bit as
it reads it, so the products are those of its float layout, bit for bit. The embedded SmolLM2's 211 layers are all
such (Q4_1 and Q8_0: 115 MB instead of 538), and its decode step reads a fifth of the bytes (see README, "The model's
dtype").

A bfloat16 weight keeps oneDNN's layout, and where the kernel builds with AVX-512 BF16 it is also laid out for the
kernel's bfloat16 products (`vdpbf16ps`, sums in float32, each output rounded once; on Intel's CPUs without AMX, where
it does half the multiply-adds a second that FMAs do, float32 FMAs on the same values, the same sums: see
cpu_linear.cpp): oneDNN's kernels lose to it on the few rows of a decode step (SmolLM2's 211 layers on 2 cores of a Xeon
with AMX: 11.6 ms for one row against 17.4 in an idle hour, 17.9 against 27.4 in a busy one) and, on AMX's tiles, win
past 8 rows; without AMX, on the same dot products, they lose up to a whole pass of 64 rows (on a Xeon without it, 0.59
of oneDNN's time for 8 rows, 0.74 for 16, 0.95 for 64, about the same past it), and against the FMAs at every count
(0.47 for 8 rows, 0.64 for 64, 0.75 for 512). So the operator gives it up to `pair_rows()` rows (8 with AMX, 64 on dot
products without it, every count on FMAs) and calls oneDNN's product on its layout, from C++, for more. Where it
takes every count, the pair panels replace oneDNN's layout; elsewhere the copy doubles the linear weights' memory
(SmolLM2: 270 MB more), so it is made only where it takes at most an eighth of the memory free at load. A bfloat16 layer
rounded from a float32 weight that is exactly GGUF blocks (the embedded SmolLM2's, whose converted folder holds them;
`_float32_sources`) is also laid out as those codes, in pair order: the kernel rebuilds each two weights in float32 and
rounds them to bfloat16 as torch rounded the weight, so its sums are the pair panels' to the bit from fewer bytes
(SmolLM2: 115 MB against 270). That is the faster for up to 5 rows (one row 8.9 ms against 12.2, five 13.2 against
14.9), the pair panels from 6 (rebuilding costs instructions: eight rows 19.7 against 18.3), so the codes take up to 5
rows.
Where the CPU has AMX, the kernel builds with it and the codes take 2 to 512 rows on its tiles (each 32 values of k of
16 outputs rebuilt into a tile once, multiplied by 16 rows in one instruction): SmolLM2's 211 layers, 16 rows 8.8 ms
against oneDNN's 18.5, 64 rows 16.0 against 23.3, 216 rows 38.9 against 44.1 and 512 rows 84.3 against 93.2 (see
README, "The model's dtype"); oneDNN's product takes more. No count of rows then reads such a layer's pair panels, so
none are made (SmolLM2: 270 MB less).

On other x86 CPUs (Intel's) MKL's products stay the faster past about 100 rows, and the kernel reading codes the faster
below (SmolLM2's 211 layers on 2 cores of a Xeon: 15.1 ms for 8 rows against MKL's 56.5, 771 for 512 against 522;
benchmarks/linear_bench.py). There, where the kernel builds, a layer whose weight is codes keeps its plain weight beside
them and the operator gives more than 64 rows to MKL (`mkl_past_64`); a layer that is not codes is not packed.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import subprocess
import weakref
from pathlib import Path

import safetensors
import torch

from prefixgate.backends import cpu_attention
from prefixgate.backends.cpu_attention import cpu_vendor

_log = logging.getLogger(__name__)

Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a weight's codes, scales and offsets (see `block_codes`)
_ROWS_HINT = 8  # the row count oneDNN lays a weight out for; every other count of rows runs on that layout too
# Every live layer packed for oneDNN by its number: the `prefixgate::packed_linear` operator takes the number, as a
# compiled step cannot take oneDNN's opaque weight as an argument.
_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


class PackedLinear(torch.nn.Module):
    """A bias-optional linear layer computed from a weight laid out once: by our kernel in float32 where it builds
    (as codes where the weight is exactly codes, see `block_codes`), by oneDNN otherwise."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        *,
        codes: bool = True,
        found: Codes | None = None,
        pairs: bool = True,
    ) -> None:
        """Pack `linear`'s weight; as codes where it is exactly codes and `codes` allows (`found`: its `block_codes`,
        where the caller has them already); a bfloat16 one for oneDNN, and where `pairs` allows for the kernel too: as
        pair panels, and also the codes `found` where they rebuild it (they are those of the float32 weight it was
        rounded from, see `prepack_linear_weights`)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        weight = linear.weight.detach()
        # The kernel's layouts (see cpu_linear.cpp and `_describe`), none of them parameters: float panels, code panels
        # with their scales and offsets, or bfloat16 pair panels; and the bias.
        self.layout: dict[str, torch.Tensor] = {}
        # The description of those layouts (`_describe`), which the kernel's operator holds by the layer's number
        self.description: torch.Tensor | None = None
        self.number = next(_NUMBERS)  # in load order: the same layer has the same number in every process (see forward)
        self.packed: torch.Tensor | None = None  # oneDNN's opaque layout of the weight, where it has one
        # The weight as torch holds it, for products of more than 64 rows where MKL's are the faster (`mkl_past_64`)
        self.plain: torch.Tensor | None = None
        with torch.no_grad():
            if weight.dtype != torch.float32 or not _kernel():
                paired = pairs and weight.dtype == torch.bfloat16 and self.in_features % 2 == 0 and bfloat16_products()
                if not (paired and pair_rows() is None):  # oneDNN's, unless the pair panels take every count
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
                    _LAYERS[self.number] = self
                if paired:
                    # the kernel's layouts: pair panels for up to `pair_rows()` rows, and before them its codes in
                    # pair order for up to 5, where they rebuild the weight; oneDNN's layout, where it is made (by the
                    # address of its C++ object, which `packed` keeps), takes more. Where the codes take 2 to 512 rows
                    # on AMX's tiles, no count of rows reads pair panels, and none are made.
                    layouts: dict[str, torch.Tensor] = {}
                    bits = 0
                    if found is not None and torch.equal(_rebuilt(*found).to(torch.bfloat16), weight):
                        layouts["codes"], bits = _halves(_pairs(found[0]).flatten(-2))
                        layouts["scales"], layouts["offsets"] = _panels(found[1]), _panels(found[2])
                    if not (layouts and amx_products()):
                        layouts["pairs"] = _pairs(weight)
                    onednn = None if self.packed is None else self.packed._cdata
                    self._describe(**layouts, bits=bits, onednn=onednn)
            else:
                if found is None and codes:
                    found = block_codes(weight)
                if found:
                    held, bits = _halves(_panels(found[0]))
                    self._describe(codes=held, scales=_panels(found[1]), offsets=_panels(found[2]), bits=bits)
                else:
                    self._describe(panels=_panels(weight))
                if mkl_past_64():
                    self.plain = weight

    def _describe(self, bits: int = 0, onednn: int | None = None, **layout: torch.Tensor) -> None:
        """Keep the kernel's layouts of the weight (and the bias) and describe them to it under the layer's number:
        `layout` by their names in its description of the weight, which points into them. The number is forgotten as
        the layer goes."""
        self.layout = dict(layout)
        if self.bias is not None:
            self.layout["bias"] = self.bias.detach().contiguous()
        pointers = {name: part.data_ptr() for name, part in self.layout.items()}
        described = _Weight(n=self.out_features, k=self.in_features, bits=bits, onednn=onednn, **pointers)
        self.description = torch.frombuffer(bytearray(described), dtype=torch.uint8)
        torch.ops.prefixgate.linear_describe(self.number, self.description)
        weakref.finalize(self, torch.ops.prefixgate.linear_forget, self.number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return `x @ weight.T + bias` for `x` of shape `[..., in_features]`. Either operator takes the layer's
        number, a constant of a compiled step's graph that is the same in every process loading the model alike, so
        torch's compile cache serves a later start (see cpu_linear.cpp's `described`)."""
        out: torch.Tensor
        if self.description is None:
            out = torch.ops.prefixgate.packed_linear(x, self.number)
        else:
            out = torch.ops.prefixgate.linear_panels(x, self.number, self.out_features, self.plain, self.bias)
        return out


class _Weight(ctypes.Structure):
    """cpu_linear.cpp's `struct prefixgate_linear_weight`."""

    _fields_ = [
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("panels", ctypes.c_void_p),
        ("codes", ctypes.c_void_p),
        ("bits", ctypes.c_int64),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("pairs", ctypes.c_void_p),
        ("onednn", ctypes.c_void_p),
    ]


# The operator of layers packed for oneDNN. A plain one: `torch.library.custom_op`'s checks cost about 5 µs more a call,
# 1 ms a step of SmolLM2's 211 layers.
_OPS = torch.library.Library("prefixgate", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("packed_linear(Tensor x, int number) -> Tensor")  # type: ignore[no-untyped-call]


def _packed_linear(x: torch.Tensor, number: int) -> torch.Tensor:
    layer = _LAYERS[number]
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
    return out


_OPS.impl("packed_linear", _packed_linear, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("prefixgate::packed_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, number: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _LAYERS[number].out_features))


_BLOCK = 32  # values of k sharing a code's scale and offset, as in cpu_linear.cpp and GGUF's block formats
# How GGUF's block formats rebuild 32 weights as float32: w = d q + o, d (and o) a half-precision number, q a small
# integer. (levels, offset): Q4_1 and Q5_1 span their block's least value to its greatest in 15 or 31 steps of d from
# o; Q8_0, Q4_0 and Q5_0 have no offset, and the largest magnitude is 127, 8 or 16 steps of d.
_FORMS = ((15, True), (31, True), (127, False), (8, False), (16, False))
_SLICE = 2**19  # blocks `block_codes` works on at a time: 64 MiB of float32 values


def block_codes(weight: torch.Tensor) -> Codes | None:
    """Return int8 codes `q` [n, k] and float32 scales `d` and offsets `o` [n, k / 32] with `d * q + o == weight` to
    the bit for a float32 weight [n, k] whose every block of 32 values along k is one of GGUF's block formats (a GGUF
    model's Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weights, dequantized to float32 as transformers loads them); None where a
    block is not. Each d is a half-precision number and each |q| at most 127, so `d * q` is exact in float32 and one
    rounding of `d * q + o` (an FMA) gives the weight again."""
    rows, k = weight.shape
    if weight.dtype != torch.float32 or k % _BLOCK:
        return None
    blocks = weight.reshape(-1, _BLOCK)
    # The first blocks first: where no form rebuilds one of them, the weight is no code (a model's own float32 weights
    # end here); else the forms that rebuilt them are tried first, as a weight is mostly in one form.
    first = {form: _rebuild(blocks[:256], *form)[3] for form in _FORMS}
    if not bool(torch.stack(list(first.values())).any(0).all()):
        return None
    forms = sorted(_FORMS, key=lambda form: not bool(first[form].all()))
    codes = torch.empty(blocks.shape, dtype=torch.int8)
    scales, offsets = torch.empty(len(blocks)), torch.empty(len(blocks))
    # A slice of blocks at a time, so that the float32 work held while it runs stays a few times 64 MiB whatever the
    # layer (a large vocabulary's output projection is gigabytes).
    for start in range(0, len(blocks), _SLICE):
        end = start + _SLICE
        q, d, low, exact = _rebuild(blocks[start:end], *forms[0])
        for form in forms[1:]:
            if bool(exact.all()):
                break
            left = ~exact  # the blocks no form has rebuilt yet
            q[left], d[left], low[left], exact[left] = _rebuild(blocks[start:end][left], *form)
        if not bool(exact.all()):
            return None
        codes[start:end], scales[start:end], offsets[start:end] = q, d, low
    return codes.reshape(rows, k), scales.reshape(rows, -1), offsets.reshape(rows, -1)


def _rebuild(
    values: torch.Tensor, levels: int, offset: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes q [blocks, 32], scales d and offsets o [blocks] of blocks of values in one of `_FORMS`, and which of the
    blocks `d * q + o` gives again to the bit."""
    low, high = torch.aminmax(values, dim=1)
    if offset:
        d = ((high - low) / levels).half().float()
    else:
        d, low = (torch.maximum(-low, high) / levels).half().float(), torch.zeros_like(low)
    divisor = torch.where(d > 0, d, 1.0)  # a block of one value (d 0) has codes 0
    q = (values - low[:, None]).div_(divisor[:, None]).round_().clamp_(-127, 127)
    rebuilt = torch.addcmul(low[:, None], d[:, None], q)
    exact = torch.ones_like(d, dtype=torch.bool) if torch.equal(rebuilt, values) else (rebuilt == values).all(1)
    return q, d, low, exact


def _rebuilt(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The float32 weight [n, k] that `block_codes` found codes, scales and offsets of."""
    rows, k = codes.shape
    blocks = torch.addcmul(offsets.reshape(-1, 1), scales.reshape(-1, 1), codes.reshape(-1, _BLOCK).float())
    return blocks.reshape(rows, k)


def _halves(codes: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Code panels as the kernel reads them, and their bits: two to a byte where every code is 0 to 15 (Q4_1's), code
    j of each panel row in the low half of byte j and code j + w / 2 in its high half (w codes a row: 16 in a float32
    panel [n / 16][k][16], 32 in a bfloat16 one [n / 16][k / 2][32]), else int8."""
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        return codes, 8
    width = codes.shape[-1] // 2
    low, high = codes[..., :width].to(torch.uint8), codes[..., width:].to(torch.uint8)
    return (low | high << 4).contiguous(), 4


def _pairs(weight: torch.Tensor) -> torch.Tensor:
    """Lay out a bfloat16 weight [n, k] (k even), or its codes, as the kernel's pair panels [n / 16][k / 2][16][2]
    (zeros past n): for each two values of k, the 16 columns' two weights side by side."""
    rows, columns = weight.shape
    padded = weight.new_zeros(((rows + 15) // 16 * 16, columns))
    padded[:rows] = weight
    return padded.reshape(-1, 16, columns // 2, 2).transpose(1, 2).contiguous()


def _panels(part: torch.Tensor) -> torch.Tensor:
    """Lay out a per-row tensor [n, columns] as the kernel's panels [n / 16][columns][16] (zeros past n)."""
    rows, columns = part.shape
    padded = part.new_zeros(((rows + 15) // 16 * 16, columns))
    padded[:rows] = part
    return padded.reshape(-1, 16, columns).transpose(1, 2).contiguous()


def prepack_linear_weights(model: torch.nn.Module) -> int:
    """Replace every plain `torch.nn.Linear` of a model on a CPU by a `PackedLinear`, in place, where its dtype is one
    `packs`; return how many were replaced (0 where it does not apply).

    The replaced layers' weights are no longer parameters: fingerprint the model before.
    """
    if not applies(model):
        return 0
    bfloat16 = next(model.parameters()).dtype == torch.bfloat16 and bfloat16_products()
    sources = _float32_sources(model) if bfloat16 else {}  # read only where bfloat16 layers could take codes
    pairs = _pairs_fit(model, sources)
    packed: dict[int, PackedLinear | None] = {}  # a layer used in several places is packed once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Plain layers only, not subclasses: quantized layers keep their own.
            if type(child) is torch.nn.Linear and id(child) not in packed:
                original = _original_codes(sources.get(id(child.weight))) if pairs else None
                packed[id(child)] = _pack(child, pairs, original)
            if packed.get(id(child)) is not None:
                setattr(parent, name, packed[id(child)])
    kept = [layer for layer in packed.values() if layer is not None]
    _log_layouts(kept)
    return len(kept)


def _log_layouts(kept: list[PackedLinear]) -> None:
    """Say in the log how the kernel holds the packed layers: codes, pair panels, and the memory they take."""
    paired = [layer for layer in kept if "pairs" in layer.layout]
    if paired:
        most = pair_rows()
        _log.info(
            "%d of %d bfloat16 linear layers are laid out for the C++ kernel %s (%.0f MB%s)",
            len(paired),
            len(kept),
            "instead of oneDNN's layout: it takes every step"
            if most is None
            else f"beside oneDNN's layout: it takes steps of up to {most} rows",
            sum(layer.layout["pairs"].nbytes for layer in paired) / 1e6,
            "" if most is None else " more",
        )
    codes = [layer for layer in kept if "codes" in layer.layout]
    held = sum(layer.layout[part].nbytes for layer in codes for part in ("codes", "scales", "offsets"))
    if any(layer.packed is not None or "pairs" in layer.layout for layer in codes):  # bfloat16 layers
        _log.info(
            "%d of %d bfloat16 linear layers also read the GGUF codes their float32 weights are, rebuilding the "
            "bfloat16 weights to the bit, for products of %s (%.0f MB more)",
            len(codes),
            len(kept),
            "up to 512 rows, 2 or more on AMX's tiles" if amx_products() else "up to 5 rows",
            held / 1e6,
        )
    elif codes:
        _log.info(
            "%d of %d linear layers are held as codes, their float32 weights being exactly GGUF blocks "
            "(%.0f MB instead of %.0f)",
            len(codes),
            len(kept),
            held / 1e6,
            sum(layer.in_features * layer.out_features * 4 for layer in codes) / 1e6,
        )


def _pairs_fit(model: torch.nn.Module, sources: dict[int, tuple[Path, str]]) -> bool:
    """Say whether a bfloat16 model's linear weights may be laid out for the kernel beside oneDNN's layout: where the
    kernel takes bfloat16 and the layouts take at most an eighth of the memory free now: pair panels, a second copy of
    the weights (SmolLM2's: 270 MB; a model of 8 billion parameters would double its 16 GB) unless they take every
    count of rows and replace oneDNN's layout, and for a weight with a float32 original in `sources` its codes at most
    (int8, and a float32 scale and offset for each 32: 1.25 bytes a weight; SmolLM2's are 115 MB), which on AMX's tiles
    are made instead of its pair panels."""
    weights = {  # those laid out so (an even width), each once however many layers share it
        id(m.weight): m.weight
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 and m.in_features % 2 == 0
    }
    if not weights or not bfloat16_products():
        return False
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    # what `_pairs` makes of each, its rows padded to 16, and its codes where they may be found (on AMX's tiles, the
    # codes instead of the pair panels: at most the panels' 2 bytes a weight)
    padded = {key: (w.shape[0] + 15) // 16 * 16 * w.shape[1] for key, w in weights.items()}
    codes, pairs = 0 if amx_products() else 1.25, 0 if pair_rows() is None else 2
    needed = sum(values * (pairs + (codes if key in sources else 0)) for key, values in padded.items())
    if needed > free // 8:
        _log.info(
            "bfloat16 linear layers stay oneDNN's alone: the C++ kernel's layout beside it could take %.0f MB, more "
            "than an eighth of the %.0f MB free",
            needed / 1e6,
            free / 1e6,
        )
        return False
    return True


def _pack(linear: torch.nn.Linear, pairs: bool = True, original: Codes | None = None) -> PackedLinear | None:
    """Return `linear` packed, or None where it stays torch's: where MKL serves prompts, a float32 layer is packed for
    decoding only as its codes (float panels beside the plain weight would double its memory for a gain at 8 to 16 rows
    alone), so its codes are looked for first and no panels are made for a layer that has none. A bfloat16 layer is
    offered `original`, the codes of the float32 weight it was rounded from."""
    weight = linear.weight.detach()
    if weight.dtype == torch.float32 and mkl_past_64() and _kernel():
        found = block_codes(weight)
        return None if found is None else PackedLinear(linear, found=found)
    return PackedLinear(linear, pairs=pairs, found=original if weight.dtype == torch.bfloat16 else None)


def _float32_sources(model: torch.nn.Module) -> dict[int, tuple[Path, str]]:
    """Return where the float32 weights a model's parameters were loaded from lie, by `id` of parameter: the file and
    name of each in its folder's safetensors files (`name_or_path`, where transformers loaded it from a folder) that is
    float32. A GGUF model converted once (see model_resolver.py) has its weights there as float32, GGUF's blocks to the
    bit, which a bfloat16 model's layers read as codes. A file that cannot be read leaves its weights out (logged)."""
    source = str(getattr(model, "name_or_path", "") or "")
    if not source or not Path(source).is_dir():  # a model made from a config has none
        return {}
    files: dict[str, Path] = {}
    for file in sorted(Path(source).glob("*.safetensors")):
        try:
            with safetensors.safe_open(str(file), "pt") as opened:
                keys = opened.keys()  # a list: the opened file is no mapping
                files.update((key, file) for key in keys if opened.get_slice(key).get_dtype() == "F32")
        except (OSError, safetensors.SafetensorError) as error:
            _log.info("the float32 weights of %s are not read as codes: %s", file, error)
    # every name of a parameter is looked for (a weight tied to another has both)
    return {
        id(parameter): (files[name], name)
        for name, parameter in model.named_parameters(remove_duplicate=False)
        if name in files
    }


def _original_codes(source: tuple[Path, str] | None) -> Codes | None:
    """Return the `block_codes` of the float32 weight at `source` (a file and a name in it, see `_float32_sources`), or
    None where there is none or it is no codes. Its first rows are tried first, so that a weight that is not codes (a
    model's own float32 weights) is not read whole."""
    if source is None:
        return None
    try:
        with safetensors.safe_open(str(source[0]), "pt") as opened:
            part = opened.get_slice(source[1])
            shape = part.get_shape()
            if len(shape) != 2 or block_codes(part[: -(-256 * _BLOCK // max(shape[1], 1))]) is None:
                return None
            return block_codes(opened.get_tensor(source[1]))
    except (OSError, safetensors.SafetensorError) as error:  # the file went or changed since it was listed
        _log.info("the float32 weight %s of %s is not read as codes: %s", source[1], source[0], error)
        return None


def prepare(model: torch.nn.Module) -> None:
    """Build and load the kernel now where `prepack_linear_weights` will pack this model's layers (10 to 15 s at a first
    start, once per source and torch); runs no torch kernel, so any thread may call it."""
    weight = next(model.parameters(), None)
    if applies(model) and weight is not None and (weight.dtype == torch.float32 or _BF16_FLAGS[-1] in _flags()):
        _kernel()


def applies(model: torch.nn.Module) -> bool:
    """Say whether `prepack_linear_weights` would pack this model's layers."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and packs(weight.dtype)


def packs(dtype: torch.dtype) -> bool:
    """Say whether linear weights of `dtype` on this CPU are prepacked: bfloat16 where oneDNN computes it; float32 on
    AMD's x86 CPUs, and on others where the kernel builds (its codes for up to 64 rows, MKL past them; see the module's
    docstring); nothing where torch has no oneDNN."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and (cpu_vendor() == "AuthenticAMD" or _kernel())


def mkl_past_64() -> bool:
    """Say whether float32 products of more than 64 rows go to MKL rather than the kernel: everywhere but on AMD's
    CPUs, where MKL's ran slower (see the module's docstring)."""
    return cpu_vendor() != "AuthenticAMD"


_SOURCE = Path(__file__).with_name("cpu_linear.cpp")
_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-mavx2", "-mfma", "-std=c++20")
_AVX512_FLAGS = ("-mavx512f",)  # added where the CPU has AVX-512: 16 columns a vector, 12 rows at a time
_BF16_FLAGS = ("-mavx512bw", "-mavx512bf16")  # and its bfloat16 products where it has AVX-512 BF16
_AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")  # and where it has AMX too, products of bfloat16 code panels on its tiles
_ON_FMA_FLAGS = ("-DON_FMA",)  # or else, on Intel's CPUs, its bfloat16 products on float32 FMAs
_built: list[tuple[str, ...]] = []  # the flags of the kernel's build that loaded, once `_kernel` has loaded one


def _flags() -> tuple[str, ...]:
    """The kernel's build flags on this CPU: AVX2 and FMA, AVX-512 where it has it, and AVX-512 BF16."""
    flags = cpu_attention.cpu_flags() or frozenset()
    if "avx512f" not in flags:
        return _FLAGS
    bfloat16 = _BF16_FLAGS if {"avx512bw", "avx512_bf16"} <= flags else ()
    amx = _AMX_FLAGS if bfloat16 and {"amx_tile", "amx_bf16"} <= flags else ()
    # without AMX on Intel's CPUs, the bfloat16 products on float32 FMAs (see cpu_linear.cpp's PAIRS_ON_FMA)
    on_fma = _ON_FMA_FLAGS if bfloat16 and not amx and cpu_vendor() == "GenuineIntel" else ()
    return _FLAGS + _AVX512_FLAGS + bfloat16 + amx + on_fma


def bfloat16_products() -> bool:
    """Say whether the kernel takes bfloat16 layers here: where it builds with AVX-512 BF16 (for up to `pair_rows()`
    rows, beside oneDNN's layout, or instead of it where that is every count)."""
    return _BF16_FLAGS[-1] in _flags() and _kernel()  # no build where it could not take them


def pair_rows() -> int | None:
    """Return the most rows a bfloat16 product takes on the kernel's pair panels, oneDNN's taking more (PAIR_ROWS in
    cpu_linear.cpp): 8 where the kernel is built with AMX, whose tiles oneDNN's products then run on; None (every
    count) where its products run on float32 FMAs; else 64."""
    if amx_products():
        return 8
    on_fma = bfloat16_products() and _ON_FMA_FLAGS[0] in _built[0]
    return None if on_fma else 64


def amx_products() -> bool:
    """Say whether the kernel multiplies bfloat16 code panels on AMX's tiles here (2 to 512 rows): where it was built
    with AMX (the CPU has it and the compiler builds it; the kernel asks Linux for the tile state as it loads, as the
    attention kernel does)."""
    return bfloat16_products() and _AMX_FLAGS[0] in _built[0]


@functools.cache
def _kernel() -> bool:
    """Build (once per source and torch) and load the float32 kernel's operator, `prefixgate::linear_panels`; say
    whether it runs here (where it does not, said once in the log: it needs what the attention kernel's float32 build
    needs, Linux on x86 with AVX2 and FMA, and a C++ compiler)."""
    why = cpu_attention.unavailable(torch.float32)
    compiler = cpu_attention.cxx_compiler()
    if why is None and compiler is None:
        why = cpu_attention.NO_CXX_COMPILER
    if why is None:
        assert compiler is not None
        wanted = _flags()
        # where the compiler cannot build AMX's tiles (an older one), the build without them
        tries = [wanted, tuple(f for f in wanted if f not in _AMX_FLAGS)] if _AMX_FLAGS[0] in wanted else [wanted]
        for flags in tries:
            try:
                built = cpu_attention.build_operator(_SOURCE, flags, compiler)
                torch.ops.load_library(built)  # type: ignore[no-untyped-call]
            except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
                why = f"building it failed ({cpu_attention.first_line(error)})"
                continue
            _built.append(flags)
            torch.library.register_fake("prefixgate::linear_panels")(_linear_panels_shape)
            kind = "AVX-512" if _AVX512_FLAGS[0] in flags else "AVX2"
            also = ", and bfloat16 steps with AVX-512 BF16" if _BF16_FLAGS[-1] in flags else ""
            also += " on float32 FMAs" if _ON_FMA_FLAGS[0] in flags else ""
            also += " and GGUF codes on AMX's tiles" if _AMX_FLAGS[0] in flags else ""
            _log.info("float32 linear layers run on the C++ kernel (%s float32%s)", kind, also)
            return True
    _log.info("linear layers run on oneDNN's and torch's products alone: the C++ kernel %s", why)
    return False


def _linear_panels_shape(
    x: torch.Tensor,
    weight: int,
    out_features: int,
    plain: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))
