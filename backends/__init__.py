"""Model backends: the protocol the engine codes against, and the local Hugging Face backend.

Exports:
- `Backend`, `KVGeometry`, `SamplingParams`, `TokenChunk`, `BlockCallback`, `FinishReason`: the protocol and the
  data that crosses it (see `backend.py`).
- `HFBackend`: a transformers causal LM on this machine (`HFBackend.load("smollm2-135m")`, a model folder or a
  `.gguf` file; or `HFBackend(model, tokenizer, model_id=...)` around objects you built). One worker thread runs
  every request a step at a time (a prefill chunk or a decode step); close it with `aclose()` or `close()`.
- `StepRecord`, `StepListener`: what the model thread reports after each step (`on_step=`), for tests and
  benchmarks.
- `resolve_model`, `ResolvedModel`, `default_model_cache_dir`, `EMBEDDED_MODEL`: model names and paths to folders.
"""

from prefixgate.backends.backend import (
    Backend,
    BlockCallback,
    FinishReason,
    KVGeometry,
    SamplingParams,
    TokenChunk,
)
from prefixgate.backends.hf_backend import HFBackend
from prefixgate.backends.model_resolver import (
    EMBEDDED_MODEL,
    ResolvedModel,
    default_model_cache_dir,
    resolve_model,
)
from prefixgate.backends.scheduler import StepListener, StepRecord

__all__ = [
    "EMBEDDED_MODEL",
    "Backend",
    "BlockCallback",
    "FinishReason",
    "HFBackend",
    "KVGeometry",
    "ResolvedModel",
    "SamplingParams",
    "StepListener",
    "StepRecord",
    "TokenChunk",
    "default_model_cache_dir",
    "resolve_model",
]
