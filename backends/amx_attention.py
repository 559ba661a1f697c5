"""A packed step's attention on CPUs with AMX: a small C kernel, built with the machine's C compiler on first use.

Over a shared prefix every query sees every key, and a decode step has few queries per KV head (SmolLM2: 3 per
stream) against thousands of keys. torch's CPU flash kernel packs the keys and values for its matrix units anew for
each block of queries and reads the prefix at about a third of the memory's speed there. This kernel packs each run of
256 keys once a call and attends every query row to it with AMX tiles (bfloat16 products summed in float32), so the
call costs little more than reading the prefix. It merges its result into the attention the step holds for those rows,
in place, so a step (`attention._attend_with_kernel`) attends each request's own positions (causally, with no mask
built) and then each shared prefix into one output, where it is returned. Measured on 2 cores, SmolLM2's 30 layers
over a 4k-token prefix: 11.0 ms for 24 query rows (8 decoding streams) against 16.4 for the flash kernel, 14.9 against
28.6 for 48 rows (README, "Serving many requests").

It takes bfloat16 with a head dimension that is a multiple of 64 (at most 256), on Linux x86 CPUs with AMX and
AVX-512 BF16, for models without sliding windows or soft-capping. It is built once per source into
`~/.cache/prefixgate/kernels` with `cc` (or `$CC`); where any of that is missing, `applies` says no and the step
attends with torch's kernels, as before.
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
from pathlib import Path
from typing import Any

import torch

_log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("amx_attention.c")
_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-shared", "-fPIC")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


def kernel_dir() -> Path:
    """Return the folder built kernels are kept in, `~/.cache/prefixgate/kernels`."""
    return Path.home() / ".cache" / "prefixgate" / "kernels"


def prepare() -> bool:
    """Build and load the kernel now rather than in the first step that needs it (about a second, once per source);
    say whether it runs here."""
    return _library() is not None


def applies(queries: torch.Tensor, kv: torch.Tensor) -> bool:
    """Say whether `attend_into` takes these queries `[1, heads, count, d]` over one layer of keys and values
    `[2, kv_heads, tokens, d]` (see the module's docstring)."""
    head_dim = queries.shape[-1]
    return (
        queries.device.type == "cpu"
        and queries.dtype == kv.dtype == torch.bfloat16
        and head_dim % 64 == 0
        and head_dim <= 256
        and kv.shape[2] > 0
        and kv.stride()[2:] == (head_dim, 1)
        and _library() is not None
    )


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
    library = _library()
    assert library is not None, "attend_into where applies() said no"
    _, heads, count, head_dim = queries.shape
    kv_heads = kv.shape[1]
    assert queries.stride(3) == out.stride(3) == 1 and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    failed = library.prefixgate_attend_into(
        queries.data_ptr(),
        queries.stride(1),
        queries.stride(2),
        kv[0].data_ptr(),
        kv[1].data_ptr(),
        kv.stride(1),
        kv.stride(1),
        kv_heads,
        heads // kv_heads,
        count,
        kv.shape[2],
        head_dim,
        scale,
        out.data_ptr(),
        out.stride(1),
        out.stride(2),
        lse.data_ptr(),
        lse.stride(1),
        lse.stride(2),
        -1 if causal_from is None else causal_from,
    )
    if failed == -2:
        raise MemoryError("the AMX attention kernel could not allocate its working memory")
    if failed:
        raise ValueError(
            f"the AMX attention kernel does not take these sizes: {tuple(queries.shape)}, {tuple(kv.shape)}"
        )


@functools.cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source) and load the kernel; None, said once in the log, where it cannot run."""
    why = _unavailable()
    if why is None:
        try:
            built = _built()
            library = ctypes.CDLL(str(built))
        except (OSError, subprocess.CalledProcessError) as error:
            why = f"building it failed ({_first_line(error)})"
        else:
            if library.prefixgate_request_amx() != 0:
                why = "Linux did not grant the AMX tile state"
            else:
                pointer, size = ctypes.c_void_p, ctypes.c_int64
                # queries, K and V, sizes, the scale; the output and lse merged into; where causality starts
                argtypes: list[Any] = [pointer, size, size, pointer, pointer, *[size] * 7, ctypes.c_float]
                library.prefixgate_attend_into.argtypes = [*argtypes, pointer, size, size, pointer, size, size, size]
                library.prefixgate_attend_into.restype = ctypes.c_int
                _log.info("packed steps attend with the AMX kernel (%s)", built)
                return library
    _log.info("packed steps attend with torch's kernels: the AMX kernel %s", why)
    return None


def _unavailable() -> str | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"runs on Linux x86 only (this is {platform.system()} {platform.machine()})"
    try:
        flags = next(
            set(line.split(":", 1)[1].split())
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return "could not read the CPU's features from /proc/cpuinfo"
    missing = [flag for flag in _CPU_FLAGS if flag not in flags]
    if missing:
        return f"needs CPU features this CPU lacks: {', '.join(missing)}"
    if _compiler() is None:
        return "needs a C compiler: none found as $CC, cc or gcc"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _built() -> Path:
    """Return the kernel's shared library, compiling it first unless this source was built already."""
    compiler = _compiler()
    assert compiler is not None
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *_FLAGS)).encode()).hexdigest()[:16]
    target = kernel_dir() / f"amx_attention-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed onto it, so that servers starting together never load a partial file.
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            partial = Path(folder) / target.name
            subprocess.run(
                [compiler, *_FLAGS, "-o", str(partial), str(_SOURCE)], check=True, capture_output=True, text=True
            )
            os.replace(partial, target)
    return target


def _first_line(error: BaseException) -> str:
    text = getattr(error, "stderr", None) or str(error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
