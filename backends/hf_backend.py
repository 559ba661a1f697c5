"""The local Hugging Face backend: a transformers causal LM on this machine, serving from cached KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import jinja2
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from prefixgate.backends import cpu_attention, packed_linear, sequence
from prefixgate.backends.admission import Admission, AdmissionStats
from prefixgate.backends.backend import (
    BlockCallback,
    KVGeometry,
    SamplingParams,
    TokenChunk,
    check_context,
    check_token_ids,
)
from prefixgate.backends.fingerprint import model_fingerprint, tokenizer_hash
from prefixgate.backends.grammar import Grammars
from prefixgate.backends.handoff import LoopHandoff
from prefixgate.backends.kv_buffers import KVBuffers, KVReservation
from prefixgate.backends.kv_cache import check_blocks, geometry_from_config, reuse_refusal, sharing_refusal
from prefixgate.backends.model_resolver import resolve_model
from prefixgate.backends.model_runner import ModelRunner, StepInput
from prefixgate.backends.sampler import Sampler
from prefixgate.backends.scheduler import Scheduler, StepCosts
from prefixgate.backends.sequence import Decoding, SequencePlan
from prefixgate.backends.shared_prefix import MIN_SHARED_TOKENS, PrefixStart, SharedPrefixes
from prefixgate.backends.text_stream import TextStream
from prefixgate.backends.token_pieces import PieceTokenizer
from prefixgate.backends.tool_calls import ToolFormat, format_for, generic
from prefixgate.backends.worker import GATHER_SECONDS, StepListener, Worker
from prefixgate.errors import (
    ConfigError,
    ContextLengthError,
    ModelError,
    ModelStoppedError,
    RequestError,
    UnsupportedModelError,
)
from prefixgate.store.block import SlotOrder
from prefixgate.threads import torch_executor, use_threads

_log = logging.getLogger(__name__)
_FIRST_ANSWER_TOKENS = 512  # answer tokens a request's buffer has room for before it first grows
# apply_chat_template's own arguments (as the installed transformers names them) and the `messages` it renders, which a
# request's template variables may not set: the server renders with them.
_RENDERING_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self",
    "kwargs",
} | {"messages"}
# Text a tokenizer must give back exactly for its tokens to bound a prompt's length in characters: runs of spaces,
# tabs and line breaks (which some normalizers collapse or drop) and stacked combining marks no character composes
# with (which accent stripping drops); normalization form C leaves it as it is.
_ROUND_TRIP_PROBE = "x  \t\n\n   q\u0301\u0302 z \r\n\t w   "
_MOST_COMPOSED = 4  # the longest canonical decomposition in Unicode: at most 4 characters compose into one
_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


class HFBackend:
    """Serve a transformers causal LM from one worker thread, many requests a step, each from its cached KV blocks."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        block_size: int = 64,
        prefill_chunk_tokens: int = 512,
        interleaved_prefill_tokens: int | None = None,
        context_length: int | None = None,
        kv_memory_budget: int | None = None,
        max_running: int = 64,
        max_waiting: int = 256,
        kv_buffer_budget: int = 1 << 30,
        min_shared_tokens: int = MIN_SHARED_TOKENS,
        on_step: StepListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prepack_weights: bool = False,
        compile_steps: bool | Literal["auto"] = False,
        gather_seconds: float = GATHER_SECONDS,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be at least 1 token, got {block_size}")
        if prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be at least 1 token, got {prefill_chunk_tokens}")
        if interleaved_prefill_tokens is not None and interleaved_prefill_tokens < 1:
            raise ConfigError(f"interleaved_prefill_tokens must be at least 1, got {interleaved_prefill_tokens}")
        if kv_memory_budget is not None and kv_memory_budget < 1:
            raise ConfigError(f"kv_memory_budget must be at least 1 byte, got {kv_memory_budget}")
        if max_running < 1 or max_waiting < 0:
            raise ConfigError(
                f"max_running must be at least 1 and max_waiting at least 0, got {max_running}, {max_waiting}"
            )
        model.eval()  # type: ignore[no-untyped-call]
        # At a first start the linear layers' kernel builds beside the attention's (10 to 15 s each on 2 cores): in a
        # thread of its own, which computes nothing with torch (see prefixgate/threads.py), joined before packing.
        linear_kernel = None
        if prepack_weights:
            linear_kernel = threading.Thread(target=packed_linear.prepare, args=(model,), name="prefixgate-build")
            linear_kernel.start()
        self.model_id = model_id
        self.context_length = context_length or _context_length(model, tokenizer)
        self.max_prompt_chars = _max_prompt_characters(tokenizer, self.context_length)
        self.geometry: KVGeometry = geometry_from_config(model.config, model.dtype, block_size)
        self._model = model
        self._tokenizer = tokenizer
        self._pieces = PieceTokenizer(tokenizer)  # chats, tokenized piece by piece (see token_pieces.py)
        self._runner = ModelRunner(model)
        self.vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
        self._eos_ids = _eos_ids(model, tokenizer)
        self.tool_format: ToolFormat = format_for(tokenizer.chat_template)
        self.reasoning_tags = _reasoning_tags(tokenizer.chat_template)
        self._grammars = Grammars(tokenizer)
        # Each token's text alone, for log probabilities: decoded once per token id, on the model thread.
        self._token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda token: str(tokenizer.decode([token], skip_special_tokens=False))
        )
        self.reuse_refusal: str | None = reuse_refusal(model.config) or self._probe_packed()
        self.prefix_reuse = self.reuse_refusal is None
        # A cache that is not plain per-token K and V stays transformers' own: it runs alone, with nothing to buffer.
        self._buffers: KVBuffers | None = None
        if self.prefix_reuse:
            self._buffers = KVBuffers(self.geometry, self.device, keep_bytes=kv_buffer_budget)
            if self.device.type == "cpu":
                cpu_attention.prepare(model.dtype)  # built now (once per source), so that no step waits for it
        self.fingerprint = model_fingerprint(model)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        budget = kv_memory_budget if kv_memory_budget is not None else default_kv_memory_budget(self.device)
        self._admission = Admission(budget_bytes=budget, max_running=max_running, max_waiting=max_waiting)
        # Why running requests copy a cached prefix each instead of reading one shared copy; None when they share.
        self.sharing_refusal: str | None = self.reuse_refusal or sharing_refusal(model.config)
        self._prefixes: SharedPrefixes | None = None
        if self._buffers is not None and self.sharing_refusal is None:
            self._prefixes = SharedPrefixes(block_size, min_tokens=min_shared_tokens)
        # Where the C kernel reads a lent prefix where it lies in an order of its own, the store's top tier should lay
        # its slots out in it (see `reads_lent_in`).
        self.slot_order: SlotOrder | None = None
        if self._prefixes is not None and self.device.type == "cpu":
            self.slot_order = cpu_attention.slot_order(model.dtype, self.geometry.head_dim, block_size)
        scheduler = Scheduler(
            chunk_tokens=prefill_chunk_tokens,
            interleaved_tokens=interleaved_prefill_tokens or prefill_chunk_tokens,
            costs=StepCosts(self._runner.context_tokens()),
            packed=self.prefix_reuse,
        )
        # Last: the fingerprint and the step costs read the weights as parameters, which packed ones are not (they
        # compute the same).
        self.prepacked = 0
        if linear_kernel is not None:
            linear_kernel.join()
            self.prepacked = packed_linear.prepack_linear_weights(model)
        self._worker = Worker(
            self._runner,
            scheduler,
            name=f"prefixgate-{model_id}",
            on_step=on_step,
            clock=clock,
            gather_seconds=gather_seconds,
        )
        # Compiled steps, where they were measured to pay: a CPU running the model with its linear weights prepacked
        # (bfloat16, or float32 on AMD's CPUs; see README, "The model's dtype"). They compile in a thread of their own;
        # steps run eagerly until then.
        self.compiling: threading.Thread | None = None
        self.steps = "eager"  # "compiling", then "compiled", or "eager" again when compiling failed
        if compile_steps == "auto":
            compile_steps = self.prepacked > 0
        if compile_steps and self.prefix_reuse:
            self.steps = "compiling"
            self.compiling = threading.Thread(
                target=self._compile,
                args=(torch.get_num_threads(),),
                name=f"prefixgate-compile-{model_id}",
                daemon=True,
            )
            self.compiling.start()

    def _compile(self, threads: int) -> None:
        """Compile the packed step (see `ModelRunner.compile`), at the lowest priority, while the model thread serves.

        The compiler is Python, and the interpreter runs one thread's Python at a time: holding it for the default 5
        ms whenever the model thread's kernels let it go, it stalled a step of 8 streams for up to 5 s. While it
        compiles, the interpreter switches threads every 0.1 ms instead (the slowest such step 0.9 s, see README)."""
        with contextlib.suppress(AttributeError, OSError):  # a thread's own priority: Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        use_threads(threads)  # inductor generates kernels for the thread count of the thread that compiles
        started = time.perf_counter()
        g = self.geometry
        buffer = torch.zeros((g.layers, 2, g.kv_heads, 2, g.head_dim), dtype=g.dtype, device=self.device)
        try:
            # Code generation in this thread, not in a pool of compiler processes (inductor's settings are per thread).
            with _switching_often(), torch.inference_mode(), torch._inductor.config.patch(compile_threads=1):
                self._runner.compile([[StepInput([0], buffer, 0)], [StepInput([0, 0], buffer, 0)]])
        except Exception as exc:  # whatever torch.compile raises, the steps stay eager
            self.steps = "eager"
            _log.warning("compiling the model's step failed, so it runs eagerly: %s: %s", type(exc).__name__, exc)
            return
        self.steps = "compiled"
        _log.info("the model's step runs compiled from now on (compiled in %.0f s)", time.perf_counter() - started)

    @classmethod
    def load(
        cls,
        model: str,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        model_cache_dir: Path | str | None = None,
        attn_implementation: str | None = None,
        **options: Any,
    ) -> HFBackend:
        """Load a model folder, GGUF file or `smollm2-135m` (blocking; use asyncio.to_thread inside a loop).

        `options` are the constructor's keyword arguments (block_size, prefill_chunk_tokens, kv_memory_budget, ...).
        It loads on every core, in a thread of its own that ends when it is done: that thread's OpenMP pool ends with
        it, and the calling thread makes none (see prefixgate.threads).
        """
        with torch_executor("prefixgate-load", threads=torch.get_num_threads(), workers=1) as loader:
            return loader.submit(
                cls._load, model, dtype, device, model_cache_dir, attn_implementation, options
            ).result()

    @classmethod
    def _load(
        cls,
        model: str,
        dtype: torch.dtype | str | None,
        device: torch.device | str | None,
        model_cache_dir: Path | str | None,
        attn_implementation: str | None,
        options: dict[str, Any],
    ) -> HFBackend:
        resolved = resolve_model(model, model_cache_dir=Path(model_cache_dir) if model_cache_dir else None)
        target = torch.device(device) if device is not None else _default_device()
        torch_dtype = _resolve_dtype(dtype, target)
        extra: dict[str, Any] = {}
        if attn_implementation is not None:
            extra["attn_implementation"] = attn_implementation
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(resolved.folder), local_files_only=True)
            hf_model = AutoModelForCausalLM.from_pretrained(
                str(resolved.folder), dtype=torch_dtype, local_files_only=True, **extra
            )
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load model {model!r} from {str(resolved.folder)!r}: {exc}") from exc
        hf_model.to(target)  # type: ignore[arg-type]
        defaults = {"prepack_weights": True, "compile_steps": "auto"}
        return cls(hf_model, tokenizer, model_id=resolved.model_id, **{**defaults, **options})

    @property
    def device(self) -> torch.device:
        """Return the device the model runs on."""
        return self._runner.device

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render chat messages with the model's own template, ending with the assistant's turn; `template_kwargs` are
        the template's other variables."""
        kwargs = dict(template_kwargs or {})
        if taken := sorted(kwargs.keys() & _RENDERING_ARGUMENTS):
            raise RequestError(
                f"chat_template_kwargs may not set {taken[0]!r}, which the server sets to render the prompt; leave it "
                "out",
                param="chat_template_kwargs",
            )
        if not self._tokenizer.chat_template:
            raise RequestError(
                f"model {self.model_id!r} has no chat template; send a plain prompt to the completions API instead",
                param="messages",
            )
        if self.tool_format is generic.FORMAT and (tools or any(_of_tools(message) for message in messages)):
            # The template renders no tools (it would drop them without a word): the system prompt tells them, and
            # earlier calls and results become plain turns.
            messages, tools = generic.render(messages, tools), None
        tool_list: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
        try:
            # Rendered to text first, then tokenized as apply_chat_template(tokenize=True) does, so that text far
            # beyond the context is refused before the tokenizer spends seconds on it.
            text = self._tokenizer.apply_chat_template(
                messages, tools=tool_list, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: a value the template cannot use (`"a" + 1`)
            raise RequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
        assert isinstance(text, str)
        return self._tokenize(text, add_special_tokens=False)

    def render_text(self, prompt: str) -> list[int]:
        """Tokenize a plain completion prompt, with the tokenizer's usual special tokens (e.g. BOS)."""
        return self._tokenize(prompt, add_special_tokens=True)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text, leaving out special tokens unless asked."""
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    def reads_lent_in(self, order: SlotOrder | None) -> None:
        if order is not None and order != self.slot_order:
            raise ValueError(
                f"the store lends prefixes laid out as {order!r}, which this model's steps do not read; open the "
                f"store with the backend's slot_order ({self.slot_order!r})"
            )
        self._runner.shared_tiled = order is not None

    def start_prefix(self, block_ids: Sequence[Hashable], forks: Sequence[int] = ()) -> PrefixStart | None:
        """Start a request from the shared prefix of its cached blocks (their ids, block 0 first; `forks` as the
        store's `held` finds them), or return None when it copies them into its own buffer (see `shared_prefix.py`).

        When the start has a `fill`, have the store lend those blocks in place and report with `filled()` at once,
        before `reserve`: others may be waiting for them. Pass the start to `reserve`, which takes it over.
        """
        if self._prefixes is None or not block_ids:
            return None
        return self._prefixes.attach(block_ids, forks)

    async def reserve(self, prompt_tokens: int, max_tokens: int, *, start: PrefixStart | None = None) -> KVReservation:
        """Wait for KV memory for a prompt and its answer (see `Backend.reserve`); check the context length first."""
        try:
            if self._worker.failure is not None:
                raise ModelStoppedError(self._worker.failure)
            check_context(self.context_length, prompt_tokens, max_tokens)
            reservation = KVReservation(
                self._buffers,
                prompt_tokens + max_tokens,
                self._first_capacity(prompt_tokens, max_tokens),
                self._admission.leave,
                start=start,
                on_resize=self._admission.adjust,
            )
            await self._admission.enter(reservation.nbytes)
            self._worker.expect()
            reservation.on_its_way(self._worker.unexpect)
        except BaseException:
            if start is not None:
                start.release()
            raise
        return reservation

    def admission(self) -> AdmissionStats:
        """Return how many requests run and wait, and the KV memory the running ones hold."""
        stats = self._admission.stats()
        if self._prefixes is None:
            return stats
        return replace(stats, shared_prefixes=len(self._prefixes), shared_bytes=self._prefixes.nbytes())

    def wait_compiled(self) -> None:
        """Block until the step's compile has ended, compiled or not (at once where none runs)."""
        if self.compiling is not None:
            self.compiling.join()

    def problem(self) -> str | None:
        """Say why the backend cannot serve (its model thread stopped on a fault), or None while it can."""
        return self._worker.failure

    def prefill_seconds(self, tokens: int) -> float | None:
        """Return what computing a prompt's first `tokens` tokens would take, as measured lately; None before any
        prompt was."""
        return self._worker.prefill_seconds(tokens)

    def generate(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        params: SamplingParams,
        on_block: BlockCallback | None = None,
        *,
        reservation: KVReservation | None = None,
        prompt_tail: bool = False,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Check the request now, then stream its tokens; work starts with iteration, stops on aclose()."""
        try:
            check_token_ids((token for token, _ in params.logit_bias), self.vocab_size, param="logit_bias")
            shared = reservation.offset if reservation is not None else 0
            if params.prompt_logprobs is not None and (cached_blocks or shared):
                # the cached prefix has no logits: its tokens' log probabilities need it computed
                raise RuntimeError("a request for its prompt's log probabilities starts from no cached prefix")
            plan = self._plan(token_ids, cached_blocks, max_tokens=params.max_tokens, prefill_only=False, shared=shared)
            plan = replace(plan, prompt_tail=prompt_tail)
        except BaseException:
            if reservation is not None:  # taken over all the same, as prefill() does: a refused request holds none
                reservation.release()
            raise
        return self._stream(plan, params, on_block if self.prefix_reuse else None, reservation)

    async def prefill(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        on_block: BlockCallback | None,
        *,
        reservation: KVReservation | None = None,
    ) -> int:
        """Compute the prompt's full blocks past `cached_blocks`, hand them to `on_block`, return tokens computed."""
        try:
            if not self.prefix_reuse:
                raise UnsupportedModelError(f"model {self.model_id!r} cannot reuse KV blocks: {self.reuse_refusal}")
            plan = self._plan(token_ids, cached_blocks, max_tokens=0, prefill_only=True)
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        if plan.prefill_end <= plan.shared + sum(block.shape[3] for block in plan.cached_blocks):
            if reservation is not None:
                reservation.release()
            return 0
        # aclosing: the sequence is dropped as this returns or is cancelled, not when the generator is collected.
        async with contextlib.aclosing(self._run(plan, None, on_block, reservation)) as items:
            item = await anext(items)
        assert isinstance(item, int), "a prefill-only sequence ends with its token count"
        return item

    async def _stream(
        self,
        plan: SequencePlan,
        params: SamplingParams,
        on_block: BlockCallback | None,
        reservation: KVReservation | None,
    ) -> AsyncGenerator[TokenChunk, None]:
        try:
            # Off the loop: a large schema takes up to a second to compile.
            constraint = (
                None if params.grammar is None else await asyncio.to_thread(self._grammars.compile, params.grammar)
            )
        except BaseException:
            if reservation is not None:
                reservation.release()
            raise
        decode = functools.partial(self.decode, skip_special_tokens=params.skip_special_tokens)
        sampler = Sampler(
            params, self.device, eos_ids=self._eos_ids, token_text=self._token_text, constraint=constraint
        )
        decoding = Decoding(
            sampler=sampler,
            text=TextStream(decode, plan.prompt, params.stop),
            eos_ids=frozenset() if params.ignore_eos else self._eos_ids,
            max_tokens=params.max_tokens,
            logprobs=params.logprobs,
            prompt_logprobs=params.prompt_logprobs,
        )
        async with contextlib.aclosing(self._run(plan, decoding, on_block, reservation)) as items:
            async for item in items:
                assert isinstance(item, TokenChunk)
                yield item
                if item.finish_reason is not None:
                    return

    async def _run(
        self,
        plan: SequencePlan,
        decoding: Decoding | None,
        on_block: BlockCallback | None,
        reservation: KVReservation | None,
    ) -> AsyncGenerator[TokenChunk | int, None]:
        """Admit the sequence (unless `reservation` is its admission), run it on the worker, pass on its results."""
        max_tokens = decoding.max_tokens if decoding is not None else 0
        memory = reservation if reservation is not None else await self.reserve(len(plan.prompt), max_tokens)
        handoff = LoopHandoff(asyncio.get_running_loop())
        seq = sequence.Sequence(self._worker.next_seq_id(), plan, memory, handoff, decoding=decoding, on_block=on_block)
        try:
            self._worker.submit(seq, expected=memory.arrive())
        except BaseException:
            memory.release()
            raise
        try:
            while True:
                item = await handoff.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            # Reached on normal end, on aclose() of the stream, on task cancellation and on errors alike: the worker
            # drops the sequence before its next step and gives its KV memory back.
            handoff.close()
            seq.cancel()

    async def aclose(self) -> None:
        """Stop the worker: cancel running work and wait for the step in progress."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the worker from synchronous code (see aclose)."""
        self._worker.close()

    def _tokenize(self, text: str, *, add_special_tokens: bool) -> list[int]:
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {self.context_length} tokens, and the prompt has "
                f"{len(text)} characters, more than that many tokens can hold (at most {limit} characters with this "
                "model's tokenizer); shorten the prompt",
                param="prompt",
            )
        if not add_special_tokens:
            return self._pieces(text)
        return [int(t) for t in self._tokenizer(text, add_special_tokens=True)["input_ids"]]

    def _plan(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        *,
        max_tokens: int,
        prefill_only: bool,
        shared: int = 0,
    ) -> SequencePlan:
        """Check a request and say what to compute: `shared` positions are read from shared prefixes, and
        `cached_blocks` follow them."""
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token", param="prompt")
        check_token_ids(prompt, self.vocab_size)
        check_context(self.context_length, len(prompt), max_tokens)
        if cached_blocks and not self.prefix_reuse:
            raise UnsupportedModelError(f"model {self.model_id!r} cannot reuse KV blocks: {self.reuse_refusal}")
        check_blocks(cached_blocks, self.geometry)
        size = self.geometry.block_size
        cached = shared + sum(block.shape[3] for block in cached_blocks)
        if cached > len(prompt):
            raise RuntimeError(
                f"{len(cached_blocks)} cached blocks cover {cached} tokens, more than the prompt's {len(prompt)}; "
                "pass only blocks of this prompt's prefix"
            )
        # Generation needs the last prompt token's logits, so at least that token is computed: a cache covering the
        # whole prompt is cut short by one token. A prefill stops at the last whole block, and loads no more.
        usable = len(prompt) // size * size if prefill_only else len(prompt) - 1
        assert shared <= usable and shared % size == 0, "shared prefixes hold whole blocks the prompt may reuse"
        return SequencePlan(
            prompt=prompt,
            cached_blocks=_leading(cached_blocks, min(cached, usable) - shared),
            known_blocks=shared // size + sum(block.shape[3] == size for block in cached_blocks),
            prefill_end=usable if prefill_only else len(prompt),
            block_size=size,
            shared=shared,
        )

    def _first_capacity(self, prompt_tokens: int, max_tokens: int) -> int:
        # Room for the prompt and the start of the answer; a longer answer grows the buffer as it goes.
        return prompt_tokens + min(max_tokens, _FIRST_ANSWER_TOKENS)

    def _probe_packed(self) -> str | None:
        """Switch the model to packed attention and run one token through it; undo it and say why if that fails.

        A buffer of the block geometry, filled with NaN, must come back with that token's K and V in every layer:
        a shape that differs from the geometry fails the write, and a layer that does not call prefixgate's
        attention (custom model code) leaves its NaN.
        """
        g = self.geometry
        # buffer: [layers, 2, kv_heads, 1, head_dim]
        buffer = torch.full((g.layers, 2, g.kv_heads, 1, g.head_dim), float("nan"), dtype=g.dtype, device=self.device)
        problem = None
        try:
            self._runner.pack()
            with torch.inference_mode():
                self._runner.run([StepInput([0], buffer, 0)])
        except Exception as exc:  # any failure here means we cannot vouch for the cache layout
            problem = f"a one-token packed step failed ({type(exc).__name__}: {exc})"
        else:
            if not bool(torch.isfinite(buffer).all()):
                problem = "a one-token packed step left KV positions unwritten: some layers keep K and V elsewhere"
        if problem is not None:
            self._runner.unpack()
            return f"its KV cache does not have the block layout: {problem}"
        return None


_COMPILING_SWITCH_SECONDS = 1e-4  # how often the interpreter switches threads while a step compiles
_switches = threading.Lock()
_compiling = 0  # compile threads running: the first sets the switch interval, the last puts it back
_switch_interval = 0.0


@contextlib.contextmanager
def _switching_often() -> Iterator[None]:
    """Switch the interpreter between threads every `_COMPILING_SWITCH_SECONDS` inside the block."""
    global _compiling, _switch_interval
    with _switches:
        if _compiling == 0:
            _switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(_COMPILING_SWITCH_SECONDS)
        _compiling += 1
    try:
        yield
    finally:
        with _switches:
            _compiling -= 1
            if _compiling == 0:
                sys.setswitchinterval(_switch_interval)


def default_kv_memory_budget(device: torch.device) -> int:
    """Return the KV memory running requests may hold by default: half the device's free memory, a quarter on a CPU.

    A CPU shares its memory with the host tier and everything else on the machine, hence the smaller share.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, free // 2)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, available // 4)


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """Return the dtype a model on `device` runs in when none is asked for, and why.

    bfloat16 halves the weights read per step and every KV block, so it runs faster wherever the hardware computes it:
    GPUs, and CPUs with AVX-512 BF16 or AMX (SmolLM2 on 2 such cores: 8 streams decode about 1.4x as fast). Other CPUs
    emulate it, slower than float32.
    """
    if device.type == "cuda":
        return torch.bfloat16, "a GPU computes bfloat16"
    if device.type == "cpu" and _cpu_computes_bfloat16():
        return torch.bfloat16, "this CPU computes bfloat16 (AVX-512 BF16 or AMX)"
    return torch.float32, f"this {device.type.upper()} does not compute bfloat16 natively"


def _cpu_computes_bfloat16() -> bool:
    # torch's own dispatch checks (torch.cpu, since 2.1); a build without them counts as a CPU without bfloat16.
    checks = (getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return any(check is not None and check() for check in checks)


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return auto_dtype(device)[0]
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _context_length(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    text = model.config.get_text_config(decoder=True)
    length = getattr(text, "max_position_embeddings", None)
    if length is None and 0 < tokenizer.model_max_length < 10**8:  # unset tokenizers report a huge sentinel
        length = tokenizer.model_max_length
    if not length:
        raise ModelError("cannot tell the model's context length from its config; pass context_length=")
    return int(length)


def _max_prompt_characters(tokenizer: PreTrainedTokenizerBase, context_length: int) -> int | None:
    """Return the most characters a prompt of `context_length` tokens can have, or None when nothing bounds it.

    No token stands for more characters than its vocabulary entry has: a byte-level BPE entry spells one byte per
    character, a SentencePiece piece writes a space as one "▁" and a byte as "<0x0A>", and an added token is its
    text. A tokenizer that gives its input back exactly puts every character into some token, so `n` characters
    take at least `n / longest` tokens; its normalizer may still compose up to `_MOST_COMPOSED` characters into one
    (NFC, NFKC). Whether the round trip holds is checked once, on a probe of what normalizers drop or collapse: a
    tokenizer that fails it can shrink text without limit, so for it only the token count decides.
    """
    try:
        ids = tokenizer.encode(_ROUND_TRIP_PROBE, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer that cannot do this much is bounded by its token count alone
        return None
    if back != _ROUND_TRIP_PROBE or longest < 1:
        return None
    return context_length * longest * _MOST_COMPOSED


def _of_tools(message: dict[str, Any]) -> bool:
    """Say whether a message is a tool call or a tool's result."""
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(i) for i in configured)
    return frozenset(ids)


def _leading(blocks: Sequence[torch.Tensor], tokens: int) -> list[torch.Tensor]:
    """Return the blocks covering the first `tokens` positions, the last cut to the positions needed."""
    kept: list[torch.Tensor] = []
    for block in blocks:
        if tokens <= 0:
            break
        kept.append(block if block.shape[3] <= tokens else block[:, :, :, :tokens])  # [layers, 2, heads, n, dim]
        tokens -= block.shape[3]
    return kept


def _reasoning_tags(chat_template: str | None) -> tuple[str, str] | None:
    """Return the tags a model thinks between when its chat template knows them (Qwen3's, DeepSeek-R1's), else None."""
    tags = ("<think>", "</think>")
    return tags if all(tag in (chat_template or "") for tag in tags) else None
