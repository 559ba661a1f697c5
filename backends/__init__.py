"""Model backends: the protocol the engine codes against, and the local Hugging Face backend.

Exports:
- `Backend`, `KVGeometry`, `SamplingParams`, `TokenChunk`, `BlockCallback`, `FinishReason`: the protocol and the
  data that crosses it (see `backend.py`); `ToolCallDelta`, `TokenLogprob`, `TopLogprob`: what a chunk carries for
  agents beside text.
- `HFBackend`: a transformers causal LM on this machine (`HFBackend.load("smollm2-135m")`, a model folder or a
  `.gguf` file; or `HFBackend(model, tokenizer, model_id=...)` around objects you built). One worker thread runs
  every admitted request in each step, one forward pass for all (decode tokens and prefill chunks); close it with
  `aclose()` or `close()`.
- `KVReservation`, `AdmissionStats`: a request's admitted share of KV memory, and the admission counts.
- `PrefixStart`: a request's start from one shared copy of its cached prefix (`HFBackend.start_prefix`), the
  store's own, which running requests read in place and attend to once per step.
- `StepRecord`, `Work`, `StepListener`: what the model thread reports after each step (`on_step=`), for tests and
  benchmarks.
- `resolve_model`, `ResolvedModel`, `default_model_cache_dir`, `EMBEDDED_MODEL`: model names and paths to folders.
"""

from prefixgate.backends.admission import AdmissionStats
from prefixgate.backends.backend import (
    Backend,
    BlockCallback,
    FinishReason,
    KVGeometry,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)
from prefixgate.backends.hf_backend import HFBackend
from prefixgate.backends.kv_buffers import KVReservation
from prefixgate.backends.model_resolver import (
    EMBEDDED_MODEL,
    ResolvedModel,
    default_model_cache_dir,
    resolve_model,
)
from prefixgate.backends.shared_prefix import PrefixStart
from prefixgate.backends.worker import StepListener, StepRecord, Work

__all__ = [
    "EMBEDDED_MODEL",
    "AdmissionStats",
    "Backend",
    "BlockCallback",
    "FinishReason",
    "HFBackend",
    "KVGeometry",
    "KVReservation",
    "PrefixStart",
    "ResolvedModel",
    "SamplingParams",
    "StepListener",
    "StepRecord",
    "TokenChunk",
    "TokenLogprob",
    "ToolCallDelta",
    "TopLogprob",
    "Work",
    "default_model_cache_dir",
    "resolve_model",
]
