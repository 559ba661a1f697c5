"""A packed step's attention on x86 CPUs: a small C kernel, built with the machine's C compiler on first use, for
bfloat16 on CPUs with AVX-512 BF16 and for float32 on CPUs with AVX2 and FMA (and a second float32 build where the CPU
has AVX-512, for calls of many rows: see `Kernels`).

Over a shared prefix every query sees every key, and a decode step has few queries per KV head (SmolLM2: 3 per stream)
against thousands of keys. torch's CPU flash kernel packs the keys and values for its matrix units anew for each block
of queries and reads the prefix at a fraction of the memory's speed there. This kernel takes each run of 256 keys once a
call and attends every query row to it: in bfloat16 products summed in float32 (on AMX tiles where the CPU has AMX, the
keys read where they lie for up to 64 rows a KV head and packed for more; packed for AVX-512 BF16 dot products
elsewhere, which on Intel's CPUs run as float32 FMAs instead, the same sums: see cpu_attention_bf16.h; on the dot
products a prefix lent by a tier laid out in `KernelOrder` is read where it lies, packed already), or in
float32 FMA products over the keys where they lie (`cpu_attention_f32.h`), so the call costs little more than reading
the prefix. It merges its result into the attention the step holds for those rows, in place, so a step
makes one call per layer for every request's own positions (writing their new keys and values first; causal, with no
mask built), then one per run of shared positions, into one output, where it is returned. Those calls are a C++
operator's, `prefixgate::attend` (`cpu_attend.cpp`), built against torch as `packed_linear`'s is, so that a compiled
step reaches the kernel with no Python between; the step is laid out for it once, here (`StepLayout`), for all its
layers. Measured on 2 cores, SmolLM2's 30 layers over a 4k-token prefix, against the flash kernel: with AMX (a Xeon),
11.0 ms for 24 query rows (8 decoding streams) against 16.4, 14.9 against 28.6 for 48 rows; with AVX-512 BF16 (an EPYC),
7.0 against 22.9 and 11.1 against 39.0 (`benchmarks/attention_bench.py`; README, "Benchmarks").

It takes bfloat16 with a head dimension that is a multiple of 64 and float32 with one that is a multiple of 16 (at most
256), on Linux x86 CPUs with the features of its build, for models without sliding windows or soft-capping. Each build
is made once per source and CPU kind into `~/.cache/prefixgate/kernels` with `cc` (or `$CC`), the operator with `c++`
(or `$CXX`); where any of that is missing, `takes` says no and the step attends with torch's kernels, as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_attention.c")
_SOURCES = (_SOURCE, _SOURCE.with_name("cpu_attention_bf16.h"), _SOURCE.with_name("cpu_attention_f32.h"))
_COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
_FLAGS = (*_COMMON_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512bf16")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512_bf16")
_AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")  # added where the CPU has AMX: its products then run on the tiles
_AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")
# added on Intel's CPUs to the build without AMX: its products then run on float32 FMAs (see cpu_attention_bf16.h)
_ON_FMA_FLAGS = ("-DON_FMA",)
_F32_FLAGS = (*_COMMON_FLAGS, "-mavx2", "-mfma", "-DFLOAT32")
_F32_CPU_FLAGS = ("avx2", "fma")
_F32_AVX512_FLAGS = ("-mavx512f",)  # a second float32 build where the CPU has AVX-512: vectors of 16 floats, not 8
_F32_AVX512_CPU_FLAGS = ("avx512f",)
# A call whose parts have at most this many query rows a KV head runs on the float32 AVX2 build where there is also an
# AVX-512 one, which takes the rest (here and in the C++ operator, which a step hands it to): see `Kernels`.
FEW_ROWS = 8
_DIM_MULTIPLE = {torch.bfloat16: 64, torch.float32: 16}  # as in cpu_attention.c
_TILED = -2  # a part's causal_from where it lies in `KernelOrder` (cpu_attention.c's TILED)
_OPERATOR_SOURCE = _SOURCE.with_name("cpu_attend.cpp")
_OPERATOR_FLAGS = ("-O2", "-shared", "-fPIC", "-std=c++20")


def kernel_dir() -> Path:
    """Return the folder built kernels are kept in, `~/.cache/prefixgate/kernels`."""
    return Path.home() / ".cache" / "prefixgate" / "kernels"


def prepare(dtype: torch.dtype) -> bool:
    """Build and load the kernel for `dtype` and the step's operator now rather than in the first step that needs them
    (about a second and 10 to 15 s, once per source); say whether steps in `dtype` attend with the kernel here."""
    return dtype in _DIM_MULTIPLE and _library(dtype) is not None and _operator() is not None


def takes(kv: torch.Tensor) -> bool:
    """Say whether the kernel attends a packed step over buffers like `kv` (`[layers, 2, kv_heads, capacity, d]`):
    through `StepLayout` and the step's C++ operator (see the module's docstring)."""
    head_dim = kv.shape[-1]
    return _sizes_fit(kv.device, kv.dtype, head_dim) and kv.stride()[3:] == (head_dim, 1) and prepare(kv.dtype)


def applies(queries: torch.Tensor, kv: torch.Tensor) -> bool:
    """Say whether `attend_into` takes these queries `[1, heads, count, d]` over one layer of keys and values
    `[2, kv_heads, tokens, d]` (see the module's docstring)."""
    head_dim = queries.shape[-1]
    return (
        _sizes_fit(queries.device, queries.dtype, head_dim)
        and queries.dtype == kv.dtype
        and kv.shape[2] > 0
        and kv.stride()[2:] == (head_dim, 1)
        and _library(queries.dtype) is not None
    )


def _sizes_fit(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Say whether the kernel takes tensors on `device` in `dtype` with heads of `head_dim` (see the module's
    docstring)."""
    multiple = _DIM_MULTIPLE.get(dtype)
    return device.type == "cpu" and multiple is not None and head_dim % multiple == 0 and head_dim <= 256


def attend_into(
    queries: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal_from: int | None = None,
) -> None:
    """Attend queries `[1, heads, count, d]` over keys and values `[2, kv_heads, tokens, d]` and merge that into
    `out` (`[1, heads, count, d]`, the queries' attention over other keys) and its log-sum-exp `lse` (`[1, heads,
    count]`, float32), in place; where `lse` is minus infinity nothing is held, and `out` is only written. Every query
    sees every key, or with `causal_from` query p sees keys `[0, causal_from + p]` (new tokens after `causal_from`
    others). Call where `applies` says so; any strides, rows of d contiguous."""
    plan = Plan([Part(0, queries.shape[2], kv.unsqueeze(0), kv.shape[2], causal_from)])
    attend_parts(queries, plan, 0, scale, out, lse)


class Part(NamedTuple):
    """Rows `[first, first + length)` of a call's queries, attended to the first `tokens` positions of a layer of `kv`
    (`[layers, 2, kv_heads, capacity, d]`, rows of d contiguous): every one, or with `causal_from` query p sees
    positions `[0, causal_from + p]` (new tokens after `causal_from` others). With `tiled`, `kv` lies in
    `KernelOrder`'s order (every query sees every key then, and `tokens` is a multiple of 32)."""

    first: int
    length: int
    kv: torch.Tensor
    tokens: int
    causal_from: int | None = None
    tiled: bool = False


class Plan:
    """Parts laid out for the kernel once, for every layer's call of a step (`attend_parts` then passes the layer).
    Laid out at every layer instead (and the kernel's use asked again), SmolLM2's 30 layers took 0.9 to 1.3 ms more
    a step of one decoding request, 2.5 ms more of one on a shared prefix (in one process, the two in turn)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = tuple(parts)
        first = self.parts[0].kv
        self.dtype, self.kv_heads, self.head_dim = first.dtype, first.shape[2], first.shape[4]
        self.layers = min(part.kv.shape[0] for part in parts)
        size = first.element_size()
        plans: list[int] = []
        for first_row, length, kv, tokens, causal_from, tiled in self.parts:
            layer, values, head, row, column = kv.stride()
            assert kv.dtype == self.dtype and kv.shape[2] == self.kv_heads and (row, column) == (self.head_dim, 1)
            assert tokens <= kv.shape[3], "a part attends positions its KV does not hold"
            keys = kv.data_ptr()  # layer 0's, in bytes
            assert not (tiled and causal_from is not None), "a tiled part is attended whole"
            causal = (_TILED if tiled else -1) if causal_from is None else causal_from
            plans += (first_row, length, keys, keys + values * size, layer * size, head, tokens, causal)
        self.laid_out = (ctypes.c_int64 * len(plans))(*plans)


def attend_parts(
    queries: torch.Tensor,
    plan: Plan,
    layer: int,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Attend each part's rows of queries `[1, heads, rows, d]` to its KV's layer `layer` as `attend_into` does, merged
    into the same rows of `out` and `lse`; a part on rows an earlier part reads merges after it. With `new`, the
    step's new keys and values (each `[1, kv_heads, rows, d]`), a causal part's rows of them are first written into its
    KV at positions `[causal_from, causal_from + length)`. One call for a step's requests, each over its own positions
    (and the shared ones they read): the threads start once and share out the work of every request, with no tensor
    made per request."""
    dtype = queries.dtype
    kernels = _library(dtype)
    assert kernels is not None, "attend_parts where applies() said no"
    _, heads, _, head_dim = queries.shape
    library = kernels.of(heads // plan.kv_heads * max(part.length for part in plan.parts))
    assert queries.stride(3) == out.stride(3) == 1 and out.dtype == dtype and lse.dtype == torch.float32
    assert plan.dtype == dtype and plan.head_dim == head_dim and 0 <= layer < plan.layers
    new_k = new_v = None
    if new is not None:
        new_k, new_v = (x if x.stride(3) == 1 else x.contiguous() for x in new)
        assert new_k.dtype == new_v.dtype == dtype
    failed = library.prefixgate_attend_parts(
        queries.data_ptr(),
        queries.stride(1),
        queries.stride(2),
        out.data_ptr(),
        out.stride(1),
        out.stride(2),
        lse.data_ptr(),
        lse.stride(1),
        lse.stride(2),
        *(_placed(new_k) + _placed(new_v)),
        plan.kv_heads,
        heads // plan.kv_heads,
        head_dim,
        scale,
        layer,
        len(plan.parts),
        plan.laid_out,
    )
    if failed == -2:
        raise MemoryError("the attention kernel could not allocate its working memory")
    if failed:
        shapes = [(part.length, tuple(part.kv.shape), part.tokens, part.causal_from) for part in plan.parts]
        raise ValueError(f"the attention kernel does not take these sizes: {tuple(queries.shape)}, {shapes}")


@dataclass(frozen=True)
class KernelOrder:
    """How a memory tier lays each slot's K and V out for the kernel's products to read them where they lie (a
    `store.block.SlotOrder`), on the build that packs each run of keys for AVX-512 BF16 dot products (TILES in
    cpu_attention_bf16.h): per KV head, each 16 positions' keys as 16 column pairs of each 32 columns by the 16 keys,
    each 32 positions' values as 16 columns of each 16 by the 32 values of each column in pairs. A prefix lent from
    such a tier is then never packed by the calls that read it; every other reader of the tier gets its blocks in
    token order (`read`). A slot holds whole groups of 32 positions: block sizes that are a multiple of 32."""

    def write(self, slot: torch.Tensor, kv: torch.Tensor) -> None:
        """Lay `kv` (`[layers, 2, kv_heads, block_size, d]`, in token order) out in `slot` (the same shape)."""
        _lay_out(kv, slot, to_tiles=True)

    def read(self, slot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Return `slot`'s K and V in token order, written into `out` (the same shape)."""
        _lay_out(slot, out, to_tiles=False)
        return out


def _lay_out(source: torch.Tensor, target: torch.Tensor, *, to_tiles: bool) -> None:
    """Lay `source`'s K and V out in `target` in `KernelOrder` (`to_tiles`), or back in token order, in C: 0.17 ms a
    block of SmolLM2's either way on the Zen 4 EPYC, where torch's copies through permuted views took 0.58 (a plain
    copy of one, 0.08)."""
    layers, two, heads, tokens, d = source.shape
    if source.stride()[3:] != (d, 1):
        source = source.contiguous()
    assert target.shape == source.shape and target.dtype == source.dtype == torch.bfloat16 and two == 2
    assert target.stride()[3:] == (d, 1) and tokens % 32 == 0 and d % 64 == 0
    assert not to_tiles or target.data_ptr() % 64 == 0, "tiles are written to 64-byte aligned memory"
    strides = (ctypes.c_int64 * 6)(*(x.stride(dim) for dim in range(3) for x in (source, target)))
    failed = _lay_out_function()(source.data_ptr(), target.data_ptr(), layers, heads, tokens, d, strides, to_tiles)
    assert failed == 0, "KernelOrder where the kernel's build takes no tiled parts"


@functools.cache
def _lay_out_function() -> Any:
    """Return the bfloat16 build's `prefixgate_lay_out`, typed."""
    kernels = _library(torch.bfloat16)
    assert kernels is not None, "KernelOrder where the bfloat16 kernel does not run"
    function = kernels.few.prefixgate_lay_out
    size = ctypes.c_int64
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, size, size, size, size, ctypes.c_void_p, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def slot_order(dtype: torch.dtype, head_dim: int, block_size: int) -> KernelOrder | None:
    """Return the order a memory tier lending prefixes to this kernel's steps lays its slots out in, where the kernel
    reads them in place that way (see `KernelOrder`); None where it reads them in token order."""
    if dtype != torch.bfloat16 or block_size % 32 or not _sizes_fit(torch.device("cpu"), dtype, head_dim):
        return None
    kernels = _library(dtype) if prepare(dtype) else None
    return KernelOrder() if kernels is not None and kernels.few.prefixgate_takes_tiles() else None


class Readers(NamedTuple):
    """Shared positions the same rows of a step read: a plan with one part a run of them (the same rows in each); and
    where those rows are not side by side in the step, their indices (`[count]`, int64 on the CPU), the parts then
    placing them from row 0 of their gathered copy."""

    plan: Plan
    rows: torch.Tensor | None = None


class StepLayout:
    """A packed step laid out for `prefixgate::attend` in C++ (`cpu_attend.cpp`), which attends each of its layers
    with the kernel: each request's own part (writing its new keys and values first), then each run of shared
    positions into its readers' rows. Set it on the thread that runs the step with `set_step`.

    The runs whose readers lie side by side in the step join the call of the requests' own parts, each merging after
    the parts before it (`prefixgate_attend_parts` merges in stages), up to the first group of readers that does not:
    one call a layer instead of one more a run. On SmolLM2's 4k prefix (bfloat16, compiled steps, 2 cores of the Zen 4
    EPYC, the prefix in one run against two, in turn in one process), a second run cost 0.17, 0.49 and 1.15 ms a step
    for 1, 8 and 16 streams as a call of its own, 0.05, 0.14 and 0.27 joined."""

    def __init__(self, own: Plan, readers: Sequence[Readers]) -> None:
        plans = (own, *(r.plan for r in readers))
        assert all((p.dtype, p.kv_heads, p.head_dim) == (own.dtype, own.kv_heads, own.head_dim) for p in plans)
        kernels = _library(own.dtype)
        assert kernels is not None and _operator() is not None, "StepLayout where takes() said no"
        joined = 0  # the leading groups of readers side by side (none where the kernel is from before stages)
        while _merges_in_stages(kernels) and joined < len(readers) and readers[joined].rows is None:
            joined += 1
        # what the addresses below point into, alive as long as this
        self.own, self.readers = own, tuple(readers)
        self._call = (ctypes.c_int64 * sum(8 * len(p.parts) for p in plans[: joined + 1])).from_buffer_copy(
            b"".join(bytes(p.laid_out) for p in plans[: joined + 1])
        )
        self._readers = (_Readers * (len(readers) - joined))(*map(_Readers.of, readers[joined:]))
        self.laid_out = _Step(
            kernel=_address(kernels.few),
            many_rows_kernel=_address(kernels.many),
            few_rows=FEW_ROWS,
            bfloat16=int(own.dtype == torch.bfloat16),
            kv_heads=own.kv_heads,
            head_dim=own.head_dim,
            layers=min(p.layers for p in plans),
            parts=len(self._call) // 8,
            plans=ctypes.addressof(self._call),
            groups=len(readers) - joined,
            readers=ctypes.addressof(self._readers),
        )


def _merges_in_stages(kernels: Kernels) -> bool:
    """Say whether a build of the kernel takes parts that read the same rows (sources from before it do not)."""
    return getattr(kernels.few, "prefixgate_merges_in_stages", None) is not None


def set_step(layout: StepLayout | None) -> None:
    """Have the calls of `prefixgate::attend` on this thread attend this step's layers (None: none, each call then
    attends with torch's kernels)."""
    operator = _operator()
    assert operator is not None, "set_step where takes() said no"
    operator.prefixgate_set_step(None if layout is None else ctypes.addressof(layout.laid_out))


class _Readers(ctypes.Structure):
    """cpu_attend.cpp's `struct prefixgate_readers`."""

    _fields_ = [
        ("count", ctypes.c_int64),
        ("rows", ctypes.c_void_p),
        ("runs", ctypes.c_int64),
        ("plans", ctypes.c_void_p),
    ]

    @classmethod
    def of(cls, readers: Readers) -> _Readers:
        rows = None if readers.rows is None else readers.rows.data_ptr()
        plan = readers.plan
        return cls(plan.parts[0].length, rows, len(plan.parts), ctypes.addressof(plan.laid_out))


class _Step(ctypes.Structure):
    """cpu_attend.cpp's `struct prefixgate_step`."""

    _fields_ = [
        ("kernel", ctypes.c_void_p),
        ("many_rows_kernel", ctypes.c_void_p),
        ("few_rows", ctypes.c_int64),
        ("bfloat16", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("layers", ctypes.c_int64),
        ("parts", ctypes.c_int64),
        ("plans", ctypes.c_void_p),
        ("groups", ctypes.c_int64),
        ("readers", ctypes.c_void_p),
    ]


def _address(library: ctypes.CDLL) -> int | None:
    """Return the address of a build's `prefixgate_attend_parts`."""
    return ctypes.cast(library.prefixgate_attend_parts, ctypes.c_void_p).value


def _placed(rows: torch.Tensor | None) -> tuple[int | None, int, int]:
    """Return a pointer to rows `[1, heads, count, d]` and their head and row strides (None, 0, 0 for none)."""
    return (None, 0, 0) if rows is None else (rows.data_ptr(), rows.stride(1), rows.stride(2))


class Kernels(NamedTuple):
    """The builds a dtype's calls run on: `few` for calls whose parts have at most `FEW_ROWS` query rows a KV head,
    `many` for the rest. Two builds only for float32 on CPUs with AVX-512, where its vectors of 16 took more time than
    AVX2's 8 for one and two decoding streams (SmolLM2's 30 layers over a 4k prefix, 2 cores of a Xeon: 10.6 and 10.9
    ms against 9.8 and 10.3) and less for more rows (16 streams 24.0 against 28.9, 16 prompts of 27 tokens 460 against
    680); each call's results are the same bits on either (see cpu_attention_f32.h)."""

    few: ctypes.CDLL
    many: ctypes.CDLL

    def of(self, rows: int) -> ctypes.CDLL:
        """Return the build for a call whose largest part has `rows` query rows a KV head."""
        return self.many if rows > FEW_ROWS else self.few


@functools.cache
def _library(dtype: torch.dtype) -> Kernels | None:
    """Build (once per source) and load the kernel for `dtype`; None, said once in the log, where it cannot run."""
    kernels, said = kernels_from(dtype)
    if kernels:
        _log.info("packed steps in %s attend with %s", _name(dtype), said)
    else:
        _log.info("packed steps in %s attend with torch's kernels: %s", _name(dtype), said)
    return kernels


def kernels_from(dtype: torch.dtype, sources: tuple[Path, ...] | None = None) -> tuple[Kernels | None, str]:
    """Build (once per source) and load the kernel for `dtype` from `sources` (this module's by default), as steps
    run it; return it, or None where it cannot run, and what to say of it: the builds it runs, or why not."""
    why = unavailable(dtype)
    if why is not None:
        return None, f"the C kernel {why}"
    # bfloat16: where the CPU has AMX its build serves every call, or where that one fails (an older compiler, a Linux
    # that does not grant the tiles), the AVX-512 BF16 build. float32: AVX2, and AVX-512 for many rows.
    failures: list[str] = []
    loaded: list[tuple[str, ctypes.CDLL]] = []  # the builds loaded, the last of `_builds` first
    for flags in reversed(_builds(dtype)):
        library = _load(flags, sources)
        if isinstance(library, str):
            failures.append(f"{library} ({build_name(flags)})")
            continue
        loaded.append((build_name(flags), library))
        if dtype != torch.float32:
            break
    if not loaded:
        return None, "the C kernel " + "; ".join(failures)
    (many_name, many), (few_name, few) = loaded[0], loaded[-1]
    names = few_name if many is few else f"{few_name}; {many_name} for calls of more than {FEW_ROWS} rows"
    return Kernels(few, many), f"the C kernel ({names})" + "".join(f"; {f}" for f in failures)


@functools.cache
def _operator() -> ctypes.CDLL | None:
    """Build (once per source and torch) and load `prefixgate::attend` in C++ (`cpu_attend.cpp`); None, said once in
    the log, where it cannot be built: steps then attend with torch's kernels."""
    compiler = cxx_compiler()
    why = NO_CXX_COMPILER
    if compiler is not None:
        try:
            built = build_operator(_OPERATOR_SOURCE, _OPERATOR_FLAGS, compiler)
            torch.ops.load_library(built)  # type: ignore[no-untyped-call]
            library = ctypes.CDLL(str(built))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            why = f"building it failed ({first_line(error)})"
        else:
            library.prefixgate_set_step.argtypes = [ctypes.c_void_p]
            library.prefixgate_set_step.restype = None
            return library
    _log.info("packed steps attend with torch's kernels: the operator that calls the C kernel %s", why)
    return None


def _load(flags: tuple[str, ...], sources: tuple[Path, ...] | None = None) -> ctypes.CDLL | str:
    """Build the kernel from `sources` (this module's, `_SOURCES`, by default) with these flags (once per source) and
    load it; or say why that failed."""
    try:
        library = ctypes.CDLL(str(build(sources or _SOURCES, flags)))
    except (OSError, subprocess.CalledProcessError) as error:
        return f"building it failed ({first_line(error)})"
    if library.prefixgate_request_amx() != 0:
        return "Linux did not grant the AMX tile state"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    # queries, output, lse, new keys and values with their strides; KV heads, groups, head size, the scale, the
    # layer; the parts
    rows: list[Any] = [pointer, size, size] * 5
    library.prefixgate_attend_parts.argtypes = [*rows, size, size, size, ctypes.c_float, size, size, pointer]
    library.prefixgate_attend_parts.restype = ctypes.c_int
    return library


def unavailable(dtype: torch.dtype) -> str | None:
    """Say why no kernel of this module's kinds is built here for `dtype` (its CPU features, a compiler); None where
    one can be."""
    if dtype not in _DIM_MULTIPLE:
        return f"takes bfloat16 and float32, not {_name(dtype)}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"runs on Linux x86 only (this is {platform.system()} {platform.machine()})"
    flags = cpu_flags()
    if flags is None:
        return "could not read the CPU's features from /proc/cpuinfo"
    missing = [flag for flag in (_CPU_FLAGS if dtype == torch.bfloat16 else _F32_CPU_FLAGS) if flag not in flags]
    if missing:
        return f"needs CPU features this CPU lacks: {', '.join(missing)}"
    if _compiler() is None:
        return "needs a C compiler: none found as $CC, cc or gcc"
    return None


@functools.cache
def cpu_vendor() -> str:
    """Return the CPU's vendor as x86 CPUs name it (`GenuineIntel`, `AuthenticAMD`), or "" where Linux does not say."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """Return the CPU's features as Linux names them in /proc/cpuinfo (`avx2`, `avx512f`, ...), or None where it does
    not say."""
    try:
        return next(
            frozenset(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return None


def _builds(dtype: torch.dtype) -> list[tuple[str, ...]]:
    """The compiler's flags of each build this CPU runs for `dtype`: for bfloat16, AVX-512 BF16 products (on float32
    FMAs on Intel's CPUs, where `vdpbf16ps` is the slower), and where the CPU has AMX, AMX tiles (used when it loads);
    for float32, AVX2 and FMA, and where the CPU has AVX-512, its vectors (for calls of many rows, see `Kernels`)."""
    if dtype == torch.float32:
        has_avx512 = all(flag in (cpu_flags() or ()) for flag in _F32_AVX512_CPU_FLAGS)
        return [_F32_FLAGS, _F32_FLAGS + _F32_AVX512_FLAGS] if has_avx512 else [_F32_FLAGS]
    plain = _FLAGS + _ON_FMA_FLAGS if cpu_vendor() == "GenuineIntel" else _FLAGS
    has_amx = all(flag in (cpu_flags() or ()) for flag in _AMX_CPU_FLAGS)
    return [plain, _FLAGS + _AMX_FLAGS] if has_amx else [plain]


def build_name(flags: tuple[str, ...]) -> str:
    """Say what a build's products run on: "AMX", "AVX-512 BF16", "AVX-512 BF16 on FMAs", "AVX-512 float32" or "AVX2
    float32"."""
    if "-DFLOAT32" in flags:
        return "AVX-512 float32" if _F32_AVX512_FLAGS[0] in flags else "AVX2 float32"
    if _AMX_FLAGS[0] in flags:
        return "AMX"
    return "AVX-512 BF16 on FMAs" if _ON_FMA_FLAGS[0] in flags else "AVX-512 BF16"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


NO_CXX_COMPILER = "needs a C++ compiler: none found as $CXX, c++ or g++"  # why a C++ operator is not built


def cxx_compiler() -> str | None:
    """Return the C++ compiler builds of C++ sources use: `$CXX`, `c++` or `g++`; None where there is none."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def build(
    sources: tuple[Path, ...], flags: tuple[str, ...], *, compiler: str | None = None, libraries: tuple[str, ...] = ()
) -> Path:
    """Return the shared library of the source `sources[0]` (the others: what it includes) built with `flags` and
    linked with `libraries` (linker arguments), compiling it first unless these sources were built so already (this
    kernel's, and `packed_linear`'s); with the C compiler unless `compiler` names another."""
    compiler = compiler or _compiler()
    assert compiler is not None
    source = b"".join(path.read_bytes() for path in sources)
    digest = hashlib.sha256(source + " ".join((compiler, *flags, *libraries)).encode()).hexdigest()[:16]
    target = kernel_dir() / f"{sources[0].stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed onto it, so that servers starting together never load a partial file.
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            partial = Path(folder) / target.name
            command = [compiler, *flags, "-o", str(partial), str(sources[0]), *libraries]  # libraries after the source
            subprocess.run(command, check=True, capture_output=True, text=True)
            os.replace(partial, target)
    return target


def build_operator(source: Path, flags: tuple[str, ...], compiler: str) -> Path:
    """Return the shared library of a torch operator's C++ `source` built with `flags` as `build` does, against this
    torch's headers and libraries with its C++ ABI; its version names the build, as a new torch in the same place
    needs one of its own (this module's operator, and `packed_linear`'s)."""
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    version = f"-DPREFIXGATE_TORCH={torch.__version__}"
    flags = (*flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", version, f"-I{root / 'include'}")
    return build((source,), flags, compiler=compiler, libraries=(f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu"))


def first_line(error: BaseException) -> str:
    """The first line of what a failed build said."""
    text = getattr(error, "stderr", None) or str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
