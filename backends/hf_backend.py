"""The local Hugging Face backend: a transformers causal LM on this machine, serving from cached KV blocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from prefixgate.backends import attention
from prefixgate.backends.backend import BlockCallback, KVGeometry, SamplingParams, TokenChunk
from prefixgate.backends.fingerprint import model_fingerprint, tokenizer_hash
from prefixgate.backends.generation_job import Decoding, GenerationJob, JobPlan
from prefixgate.backends.handoff import LoopHandoff
from prefixgate.backends.kv_buffers import KVBuffers
from prefixgate.backends.kv_cache import cache_layout_problem, check_blocks, geometry_from_config, reuse_refusal
from prefixgate.backends.model_resolver import resolve_model
from prefixgate.backends.model_runner import ModelRunner
from prefixgate.backends.sampler import Sampler
from prefixgate.backends.scheduler import Scheduler, StepListener
from prefixgate.backends.text_stream import TextStream
from prefixgate.errors import (
    ConfigError,
    ContextLengthError,
    ModelError,
    RequestError,
    UnsupportedModelError,
)

_FIRST_ANSWER_TOKENS = 512  # answer tokens a request's cache has room for before it first grows
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
    """Serve a transformers causal LM from one worker thread, starting each request from cached KV blocks."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_id: str,
        block_size: int = 64,
        prefill_chunk_tokens: int = 512,
        context_length: int | None = None,
        kv_buffer_budget: int = 1 << 30,
        on_step: StepListener | None = None,
    ) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be at least 1 token, got {block_size}")
        if prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be at least 1 token, got {prefill_chunk_tokens}")
        model.eval()  # type: ignore[no-untyped-call]
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(attention.NAME)  # the same SDPA, without a copy of K and V on the CPU
        self.model_id = model_id
        self.context_length = context_length or _context_length(model, tokenizer)
        self.geometry: KVGeometry = geometry_from_config(model.config, model.dtype, block_size)
        self._model = model
        self._tokenizer = tokenizer
        self._runner = ModelRunner(model)
        self._prefill_chunk_tokens = prefill_chunk_tokens
        self._vocab_size = int(model.config.get_text_config(decoder=True).vocab_size)
        self._eos_ids = _eos_ids(model, tokenizer)
        self.reuse_refusal: str | None = reuse_refusal(model.config, self.context_length) or self._probe_layout()
        self.prefix_reuse = self.reuse_refusal is None
        # A cache that is not plain per-token K and V stays transformers' own; it has nothing to put in a buffer.
        self._buffers = (
            KVBuffers(self.geometry, self.device, keep_bytes=kv_buffer_budget) if self.prefix_reuse else None
        )
        self.fingerprint = model_fingerprint(model)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        self._scheduler = Scheduler(name=f"prefixgate-{model_id}", on_step=on_step)

    @classmethod
    def load(
        cls,
        model: str,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        block_size: int = 64,
        prefill_chunk_tokens: int = 512,
        model_cache_dir: Path | str | None = None,
        context_length: int | None = None,
        attn_implementation: str | None = None,
        kv_buffer_budget: int = 1 << 30,
        on_step: StepListener | None = None,
    ) -> HFBackend:
        """Load a model folder, GGUF file or `smollm2-135m` (blocking; use asyncio.to_thread inside a loop)."""
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
        return cls(
            hf_model,
            tokenizer,
            model_id=resolved.model_id,
            block_size=block_size,
            prefill_chunk_tokens=prefill_chunk_tokens,
            context_length=context_length,
            kv_buffer_budget=kv_buffer_budget,
            on_step=on_step,
        )

    @property
    def device(self) -> torch.device:
        """Return the device the model runs on."""
        return self._runner.device

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render chat messages with the model's own template, ending with the assistant's turn."""
        if not self._tokenizer.chat_template:
            raise RequestError(
                f"model {self.model_id!r} has no chat template; send a plain prompt to the completions API instead",
                param="messages",
            )
        if tools and "tools" not in self._tokenizer.chat_template:
            # Rendering would drop them without a word, and the model would answer as if it had no tools.
            raise RequestError(
                f"model {self.model_id!r}'s chat template does not render tools; leave tools out", param="tools"
            )
        tool_list: list[dict[Any, Any] | Callable[..., Any]] | None = list(tools) if tools is not None else None
        try:
            encoded = self._tokenizer.apply_chat_template(
                messages, tools=tool_list, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc
        return [int(t) for t in encoded["input_ids"]]  # type: ignore[call-overload, index]

    def render_text(self, prompt: str) -> list[int]:
        """Tokenize a plain completion prompt, with the tokenizer's usual special tokens (e.g. BOS)."""
        return [int(t) for t in self._tokenizer(prompt)["input_ids"]]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text, leaving out special tokens unless asked."""
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)
        return text

    def kv_buffer(self, prompt_tokens: int, max_tokens: int) -> torch.Tensor | None:
        """Lend a buffer from this backend's pool to fetch a prompt's cached prefix into (see `Backend.kv_buffer`)."""
        return None if self._buffers is None else self._buffers.lend(self._capacity(prompt_tokens, max_tokens))

    def return_kv_buffer(self, buffer: torch.Tensor) -> None:
        """Give back a lent buffer no blocks were fetched into (see `Backend.return_kv_buffer`)."""
        if self._buffers is not None:
            self._buffers.give_back(buffer)

    def generate(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        params: SamplingParams,
        on_block: BlockCallback | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Check the request now, then stream its tokens; work starts with iteration, stops on aclose()."""
        if params.n != 1:
            raise RequestError(
                f"this backend generates one choice per request (n=1), got n={params.n}; send n separate requests",
                param="n",
            )
        plan = self._plan(token_ids, cached_blocks, reserve=params.max_tokens, prefill_only=False)
        decoding = Decoding(
            sampler=Sampler(params, self.device),
            text=TextStream(self.decode, plan.prompt, params.stop),
            eos_ids=self._eos_ids,
            max_tokens=params.max_tokens,
        )
        return self._stream(plan, decoding, on_block if self.prefix_reuse else None)

    async def prefill(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        on_block: BlockCallback | None,
    ) -> int:
        """Compute the prompt's full blocks past `cached_blocks`, hand them to `on_block`, return tokens computed."""
        if not self.prefix_reuse:
            raise UnsupportedModelError(f"model {self.model_id!r} cannot reuse KV blocks: {self.reuse_refusal}")
        plan = self._plan(token_ids, cached_blocks, reserve=0, prefill_only=True)
        if plan.prefill_end <= len(plan.cached_blocks) * plan.block_size:
            return 0
        handoff = LoopHandoff(asyncio.get_running_loop())
        job = GenerationJob(
            self._scheduler.next_job_id(), self._runner, self._buffers, plan, handoff, decoding=None, on_block=on_block
        )
        self._scheduler.submit(job)
        try:
            item = await handoff.get()
        finally:
            handoff.close()
            job.cancel()
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, int)
        return item

    async def aclose(self) -> None:
        """Stop the worker: cancel running work and wait for the step in progress."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the worker from synchronous code (see aclose)."""
        self._scheduler.close()

    async def _stream(
        self, plan: JobPlan, decoding: Decoding, on_block: BlockCallback | None
    ) -> AsyncGenerator[TokenChunk, None]:
        handoff = LoopHandoff(asyncio.get_running_loop())
        job = GenerationJob(
            self._scheduler.next_job_id(),
            self._runner,
            self._buffers,
            plan,
            handoff,
            decoding=decoding,
            on_block=on_block,
        )
        self._scheduler.submit(job)
        try:
            while True:
                item = await handoff.get()
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, TokenChunk)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            # Reached on normal end, on aclose() of this generator, on task cancellation and on errors alike:
            # the worker drops the job before its next step.
            handoff.close()
            job.cancel()

    def _plan(
        self, token_ids: Sequence[int], cached_blocks: Sequence[torch.Tensor], *, reserve: int, prefill_only: bool
    ) -> JobPlan:
        prompt = [int(t) for t in token_ids]
        if not prompt:
            raise RequestError("the prompt is empty; send at least one token", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise RequestError(
                f"token ids must be between 0 and {self._vocab_size - 1} for model {self.model_id!r}",
                param="prompt",
            )
        limit = self.context_length
        if len(prompt) > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt)}; "
                "shorten the prompt",
                param="prompt",
            )
        if len(prompt) + reserve > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; the prompt has {len(prompt)} and "
                f"max_tokens asks for {reserve} more; lower max_tokens to at most {limit - len(prompt)}",
                param="max_tokens",
            )
        if cached_blocks and not self.prefix_reuse:
            raise UnsupportedModelError(f"model {self.model_id!r} cannot reuse KV blocks: {self.reuse_refusal}")
        check_blocks(cached_blocks, self.geometry)
        size = self.geometry.block_size
        if len(cached_blocks) * size > len(prompt):
            raise RuntimeError(
                f"{len(cached_blocks)} cached blocks cover {len(cached_blocks) * size} tokens, more than the "
                f"prompt's {len(prompt)}; pass only blocks of this prompt's prefix"
            )
        # Generation needs the last prompt token's logits, so at least that token is computed: when blocks cover
        # the whole prompt the last one is dropped and recomputed (blocks are whole, tokens cannot be split off).
        usable = len(prompt) // size if prefill_only else (len(prompt) - 1) // size
        return JobPlan(
            prompt=prompt,
            cached_blocks=list(cached_blocks[:usable]),
            known_blocks=len(cached_blocks),
            prefill_end=usable * size if prefill_only else len(prompt),
            capacity=self._capacity(len(prompt), reserve),
            block_size=size,
            # Chunked prefill continues a restored cache, which is just what a refused model cannot be trusted to
            # do (state-space layers in transformers recompute from scratch on a multi-token step): one pass.
            chunk_tokens=self._prefill_chunk_tokens if self.prefix_reuse else len(prompt),
        )

    def _capacity(self, prompt_tokens: int, max_tokens: int) -> int:
        # Room for the prompt and the start of the answer; a longer answer grows the cache as it goes.
        return prompt_tokens + max(0, min(max_tokens, _FIRST_ANSWER_TOKENS, self.context_length - prompt_tokens))

    def _probe_layout(self) -> str | None:
        """Run one token through the model and check its cache against the geometry; describe a mismatch."""
        cache = DynamicCache(config=self._model.config)
        try:
            with torch.inference_mode():
                self._runner.forward([0], cache)
        except Exception as exc:  # any failure here means we cannot vouch for the cache layout
            return f"a one-token probe of the KV cache failed ({type(exc).__name__}: {exc})"
        problem = cache_layout_problem(cache, self.geometry, seq_len=1)
        return None if problem is None else f"its KV cache does not have the block layout: {problem}"


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        # bfloat16 halves memory and KV block size on GPUs; CPUs run float32 much faster than bfloat16.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
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
