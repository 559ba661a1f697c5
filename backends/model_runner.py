"""The model runner: one forward pass of a causal LM for a whole step, many requests packed into one row."""

from __future__ import annotations

import functools
import inspect
import math
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import PythonKeyTracer
from transformers import DynamicCache, PreTrainedModel

from prefixgate.backends import attention
from prefixgate.backends.attention import PackedBatch, Segment
from prefixgate.errors import UnsupportedModelError

_CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")  # newest name first
# The share of the matrix products' arithmetic per second that attention gets through. Measured on SmolLM2 and a CPU,
# in float32 and bfloat16 alike: a prompt token's attention cost as much as the rest of its layer at 1,750 to 2,100
# positions of context, where counting the arithmetic says 3,070.
_ATTENTION_EFFICIENCY = 0.6


@dataclass(frozen=True, slots=True)
class StepInput:
    """One request's share of a packed step: the tokens to feed after what its buffer already holds."""

    token_ids: Sequence[int]
    kv: torch.Tensor  # kv: [layers, 2, kv_heads, capacity, head_dim], filled up to `start`; position p at p - offset
    start: int
    offset: int = 0  # positions held in `shared` instead of `kv`
    shared: tuple[torch.Tensor, ...] = ()  # the shared prefixes it starts from, root first (see attention.Segment)
    every_logit: bool = False  # the logits of every token fed, not only of the last (a prompt's log probabilities)


_Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # input ids, positions, last -> logits


# An operator that returns copies of its tensors, which a compiled graph cannot see into: what it returns is a buffer,
# computed once. See `_rotate_by_stored_angles`.
_OPS = torch.library.Library("prefixgate", "FRAGMENT")  # type: ignore[no-untyped-call]
_OPS.define("stored(Tensor[] tensors) -> Tensor[]")  # type: ignore[no-untyped-call]
_OPS.impl("stored", lambda tensors: [t.clone() for t in tensors], "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


@torch.library.register_fake("prefixgate::stored")  # type: ignore[untyped-decorator]
def _(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in tensors]


def _rotate_by_stored_angles(model: PreTrainedModel) -> None:
    """Have the model's rotary embeddings hand their cosines and sines through `prefixgate::stored`, once.

    A compiled step otherwise computes them again in every layer, for every query and key head: inductor inlines the
    cheap-looking pointwise work of `cos(position * frequency)` into each kernel that rotates, rather than storing it.
    Measured on SmolLM2 in bfloat16, 2 cores, the two compiled in one process and run in turn (two runs): a step of 16
    prompts of 27 tokens took 86.5 and 89.3 ms against 91.7 and 92.7, a 512-token prompt 110.7 and 111.5 against 114.8
    and 115.3; decoding steps the same within noise (the operator costs about 40 µs a step).
    """
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        forward = module.forward

        def stored(*args: Any, forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            angles = forward(*args, **kwargs)  # (cos, sin) in every family that has one
            if isinstance(angles, tuple) and angles and all(isinstance(t, torch.Tensor) for t in angles):
                return tuple(torch.ops.prefixgate.stored(list(angles)))
            return angles

        module.forward = stored


# torch.fx traces by replacing `torch.nn.Module.__call__` for every module in the process while it traces, and
# torch.compile traces (its graphs, inductor's patterns) in the thread that compiles a step while the model thread
# serves eagerly. Most tracers make each call a node of their graph, and an eager step whose modules were called in
# such a moment failed ("module is not installed as a submodule", a soak's requests in the minutes after a start,
# benchmarks/soak.py). So such a trace and an eager step never overlap: each takes this lock (reentrant: traces nest),
# and an eager step waits for a trace under way. make_fx's tracer, which traces the whole step for AOT autograd (one
# trace of 5 s on 2 cores), runs every module as it is called instead, and does without the lock.
_TRACING = threading.RLock()


def _passes_calls_through(tracer: torch.fx.Tracer) -> bool:
    """Whether a tracer, while it traces, leaves other threads' module calls as they were: make_fx's runs each module
    as it is and hands back its attributes as they are, and wraps no functions (the tracers built on it that record
    module paths define their own calls, and take the lock)."""
    kind = type(tracer)
    return (
        kind.call_module is PythonKeyTracer.call_module
        and kind.getattr is PythonKeyTracer.getattr
        and not getattr(tracer, "_autowrap_function_ids", True)
    )


def _traced_alone(trace: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(trace)
    def alone(tracer: torch.fx.Tracer, *args: Any, **kwargs: Any) -> Any:
        if _passes_calls_through(tracer):
            return trace(tracer, *args, **kwargs)
        with _TRACING:
            return trace(tracer, *args, **kwargs)

    alone.__wrapped_by_prefixgate__ = True  # type: ignore[attr-defined]
    return alone


def _trace_alone() -> None:
    """Have every torch.fx trace that reaches other threads' module calls take `_TRACING` (once per process)."""
    if not getattr(torch.fx.Tracer.trace, "__wrapped_by_prefixgate__", False):
        torch.fx.Tracer.trace = _traced_alone(torch.fx.Tracer.trace)  # type: ignore[method-assign]


def _call_compiled(
    compiled: _Step, input_ids: torch.Tensor, position_ids: torch.Tensor, last: torch.Tensor, *, compile_new: bool
) -> torch.Tensor:
    """Run a compiled step, its sizes marked as sizes that vary; without `compile_new`, a step no graph takes runs
    eagerly instead of compiling one."""
    if input_ids.shape[1] > 1:
        torch._dynamo.mark_dynamic(input_ids, 1)
        torch._dynamo.mark_dynamic(position_ids, 1)
    torch._dynamo.mark_dynamic(last, 0)
    with torch.compiler.set_stance("default" if compile_new else "eager_on_recompile"):
        return compiled(input_ids, position_ids, last)


class ModelRunner:
    """Run forward passes of one model; call only from the thread that owns the model."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.device: torch.device = torch.device(model.device)
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed the forward arguments `past_key_values` (attention) and `cache_params` (state
        # space) to `cache`; the old names still work but warn, and go in 5.40. The signature says which one this
        # release takes; a version string would not cover backports or models with custom code.
        names = [name for name in _CACHE_ARGUMENTS if name in params]
        if not names:
            raise UnsupportedModelError(
                f"{type(model).__name__}.forward takes none of {', '.join(_CACHE_ARGUMENTS)}; "
                "prefixgate needs a causal LM that accepts a KV cache"
            )
        self.cache_argument = names[0]
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._unpacked = str(model.config._attn_implementation)
        self._step: _Step = self._eager_alone  # the packed step `run` takes: eager, or compiled once `compile` is done
        # Whether the shared prefixes steps read lie in the C kernel's order (see `attention.PackedBatch`): the order of
        # the store's tier that lends them, as the backend is told.
        self.shared_tiled = False

    def context_tokens(self) -> float:
        """Return the context at which a new token's attention costs about as much as the rest of its layer; infinity
        for a model whose shape does not say (no attention heads, or layers of differing shapes).

        Per token, a layer's matrix products take 2 operations per weight; attention takes 4 per position of context
        and query-head dimension (scores, then the weighted sum of values).
        """
        text = self.config.get_text_config(decoder=True)
        try:
            heads = int(text.num_attention_heads)
            head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
            layers = int(text.num_hidden_layers)
        except (AttributeError, RuntimeError, TypeError):  # RuntimeError: a per-layer value read as one
            return math.inf
        embeddings = {
            id(p)
            for module in (self.model.get_input_embeddings(), self.model.get_output_embeddings())  # type: ignore[no-untyped-call]
            if module is not None
            for p in module.parameters()
        }
        weights = sum(p.numel() for p in self.model.parameters() if id(p) not in embeddings)
        return max(1.0, weights / layers / (2 * heads * head_dim) * _ATTENTION_EFFICIENCY)

    def pack(self) -> None:
        """Run this model's attention as packed attention from now on (see `attention.py`)."""
        self.model.set_attn_implementation(attention.NAME)

    def unpack(self) -> None:
        """Go back to the attention the model had before `pack()`."""
        if self._unpacked != attention.NAME:
            self.model.set_attn_implementation(self._unpacked)

    def run(self, inputs: Sequence[StepInput]) -> torch.Tensor:
        """Feed every input's tokens in one packed forward pass; return each input's last-position logits, or each of
        its positions' where it asks for `every_logit`, in order (`[rows, vocab]`).

        Each input's new K and V land in its buffer at positions `[start, start + len(token_ids))`.
        """
        return self._run(self._step, inputs)

    def compile(self, warm_ups: Sequence[Sequence[StepInput]]) -> None:
        """Compile the packed step with `torch.compile` and have `run` take it from its next step (blocking, in a
        thread of its own while `run` goes on eagerly in the model thread). Raises what compiling raised; `run` then
        stays eager.

        The step's size (its tokens, its segments) varies from step to step, so each graph takes it as a size that
        varies, except a size of 1, which makes a graph of its own: `warm_ups` are steps that compile each graph
        needed (one of one token, one of more), and `run` compiles nothing more: a step that no graph takes runs
        eagerly, so the model thread never stops to compile.
        """
        # The model's modules go unguarded: before each compiled step Dynamo checked every module and parameter of
        # SmolLM2 for changes (0.85 ms a step, `torch.profiler`; 0.2 without them). Nothing changes a model once its
        # step is compiled (`pack` comes before); the inputs' guards, which pick a graph by their sizes, stay. Dynamo
        # keeps graphs per code object and only those guards told two models apart, so each runner compiles a code
        # object of its own: with one shared, a second model in the process took the first one's graphs.
        # On a CPU the graph's calls are C++ (`cpp_wrapper`): the Python that inductor generates otherwise, calling the
        # graph's few hundred kernels and operators one by one, took 2.8 ms of a step of one stream of SmolLM2, the C++
        # 1.2 (`torch.profiler`). It compiles slower from nothing: 135 s against 93 on 2 cores (README, "Benchmarks").
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe
        }
        if self.device.type == "cpu":
            options["cpp_wrapper"] = True
        _rotate_by_stored_angles(self.model)
        _trace_alone()
        eager = types.FunctionType(ModelRunner._eager.__code__.replace(), ModelRunner._eager.__globals__)
        compiled = torch.compile(types.MethodType(eager, self), dynamic=False, options=options)
        for inputs in warm_ups:
            self._run(functools.partial(_call_compiled, compiled, compile_new=True), inputs)
        self._step = functools.partial(_call_compiled, compiled, compile_new=False)

    def _run(self, step: _Step, inputs: Sequence[StepInput]) -> torch.Tensor:
        assert self._takes_logits_to_keep, "packed steps need logits_to_keep (every packed model has it)"
        # Packed by the shared prefixes they read (root first, so that a nested prefix's readers come together inside
        # its parent's), the rest in the order given: readers side by side join the requests' one kernel call a layer
        # (`cpu_attention.StepLayout`) where readers apart are gathered for calls of their own. Compiled steps of 8
        # streams on SmolLM2's 4k prefix with 8 short ones (bfloat16, 2 cores of the Zen 4 EPYC, in turn in one process)
        # took 28.12 ms interleaved against 27.21 grouped.
        order: Sequence[int] = range(len(inputs))
        if any(i.shared for i in inputs):
            order = sorted(order, key=lambda index: tuple(map(id, inputs[index].shared)))
        packed = [inputs[index] for index in order]
        segments = tuple(Segment(i.kv, i.start, len(i.token_ids), i.offset, i.shared) for i in packed)
        batch = PackedBatch.of(segments, self.device, shared_tiled=self.shared_tiled)
        ids = [token for i in packed for token in i.token_ids]
        positions = [p for i in packed for p in range(i.start, i.start + len(i.token_ids))]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # input_ids: [1, total]
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)  # position_ids: [1, total]
        # The positions whose logits are kept, in the inputs' order: each one's last token, or every token of those
        # that ask.
        ends = dict(zip(order, batch.cu_seqlens[1:], strict=True))
        kept: list[int] = []
        for index, i in enumerate(inputs):
            end = ends[index]
            kept.extend(range(end - len(i.token_ids), end) if i.every_logit else (end - 1,))
        # last: [max(kept, 2)]; a single position twice, so that the count is never 1 (a graph of its own when compiled)
        last = torch.tensor(kept * (2 if len(kept) == 1 else 1), device=self.device)
        with attention.packed_step(batch):
            logits = step(input_ids, position_ids, last)  # logits: [1, len(last), vocab]
        return logits[0, : len(kept)].float()

    def _eager_alone(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The eager step, never while another thread traces (see `_TRACING`)."""
        with _TRACING:
            return self._eager(input_ids, position_ids, last)

    def _eager(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        output = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=last)
        logits = output.logits
        assert isinstance(logits, torch.Tensor)
        return logits

    def run_alone(self, token_ids: Sequence[int], cache: DynamicCache, *, every_logit: bool = False) -> torch.Tensor:
        """Feed `token_ids` after what transformers' own `cache` holds; return the last position's logits (`[1,
        vocab]`), or with `every_logit` every position's (`[len(token_ids), vocab]`).

        For models whose cache is not per-token K and V (state-space, hybrid layers): they run one request a step.
        """
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)  # ids: [1, new]
        kwargs: dict[str, object] = {self.cache_argument: cache, "use_cache": True}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = 0 if every_logit else 1  # 0: every position's
        # Position ids are left to the model: it counts them from the cache length.
        logits = self.model(input_ids=input_ids, **kwargs).logits  # logits: [1, kept, vocab]
        assert isinstance(logits, torch.Tensor)
        return logits[0, -len(token_ids) if every_logit else -1 :].float()
