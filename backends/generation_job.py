"""The generation job: one request's work on the model thread, as a sequence of prefill chunks and decode steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from prefixgate.backends.backend import BlockCallback, TokenChunk
from prefixgate.backends.kv_buffers import KVBuffers
from prefixgate.backends.kv_cache import build_cache, cut_block
from prefixgate.backends.model_runner import ModelRunner
from prefixgate.backends.sampler import Sampler
from prefixgate.backends.scheduler import StepKind
from prefixgate.backends.text_stream import TextStream


class JobConsumer(Protocol):
    """Where a job's results go; each call returns False once nobody is listening any more."""

    def token(self, chunk: TokenChunk) -> bool:
        """Deliver one generated token."""
        ...

    def prefilled(self, tokens: int) -> bool:
        """Deliver the end of a prefill-only job and how many tokens it computed."""
        ...

    def error(self, error: BaseException) -> None:
        """Deliver the error that ended the job."""
        ...


@dataclass(frozen=True, slots=True)
class Decoding:
    """What a job needs to generate after its prefill: how to pick tokens, render text and stop."""

    sampler: Sampler
    text: TextStream
    eos_ids: frozenset[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class JobPlan:
    """What to compute: the prompt, the cached blocks to start from, and where prefill ends."""

    prompt: Sequence[int]
    cached_blocks: Sequence[torch.Tensor]  # the blocks to load; already checked and trimmed
    known_blocks: int  # blocks the caller already has (passed in), never handed back again
    prefill_end: int  # prompt tokens to have in the cache when prefill ends
    capacity: int  # tokens to make room for at first (the cache grows past it when it must)
    block_size: int
    chunk_tokens: int


class GenerationJob:
    """Prefill a prompt from cached blocks in chunks, then decode (or stop, for a prefill-only job)."""

    def __init__(
        self,
        job_id: int,
        runner: ModelRunner,
        buffers: KVBuffers | None,
        plan: JobPlan,
        consumer: JobConsumer,
        *,
        decoding: Decoding | None,
        on_block: BlockCallback | None,
    ) -> None:
        self.job_id = job_id
        self._runner = runner
        self._buffers = buffers
        self._plan = plan
        self._consumer = consumer
        self._decoding = decoding
        self._on_block = on_block
        self._tokens = list(plan.prompt)  # prompt, then each generated token as it is picked
        self._pending_blocks: Sequence[torch.Tensor] = plan.cached_blocks
        self._start = len(plan.cached_blocks) * plan.block_size
        self._pos = self._start  # tokens whose K and V are in the cache
        self._next_block = len(plan.cached_blocks)
        self._cache: DynamicCache | None = None
        self._buffer: torch.Tensor | None = None  # where the cache lives, until release()
        self._generated = 0
        self._outbox: TokenChunk | int | None = None  # the last step's result, until publish()
        self._finished = False
        self._cancelled = False

    @property
    def finished(self) -> bool:
        """Say whether the job has nothing left to run."""
        return self._finished

    @property
    def cancelled(self) -> bool:
        """Say whether the job's consumer has gone."""
        return self._cancelled

    def cancel(self) -> None:
        """Ask the worker to drop this job before its next step (safe from any thread)."""
        self._cancelled = True

    def step(self) -> tuple[StepKind, int]:
        """Run one prefill chunk or one decode step."""
        if self._cache is None:
            if self._buffers is None:  # a model whose cache is not plain K and V: transformers' own, from empty
                self._cache = DynamicCache(config=self._runner.config)
            else:
                self._buffer = self._buffers.adopt_or_take(self._pending_blocks, self._plan.capacity)
                self._cache = build_cache(self._buffer, self._start, self._runner.config)
            self._pending_blocks = ()
        plan = self._plan
        if self._pos < plan.prefill_end:
            chunk = self._tokens[self._pos : min(self._pos + plan.chunk_tokens, plan.prefill_end)]
            logits = self._runner.forward(chunk, self._cache)  # logits: [vocab]
            self._pos += len(chunk)
            self._hand_back_blocks(self._cache)
            if self._pos == plan.prefill_end:
                self._end_prefill(logits)
            return "prefill", len(chunk)
        logits = self._runner.forward(self._tokens[-1:], self._cache)  # logits: [vocab]
        self._pos += 1
        self._hand_back_blocks(self._cache)
        self._take(logits)
        return "decode", 1

    def publish(self) -> None:
        """Deliver the last step's token (or prefill count) to the consumer; a gone consumer cancels the job."""
        item, self._outbox = self._outbox, None
        if item is None:
            return
        delivered = self._consumer.token(item) if isinstance(item, TokenChunk) else self._consumer.prefilled(item)
        if not delivered:
            self._cancelled = True

    def fail(self, error: BaseException) -> None:
        """Deliver an error to the consumer and drop the job's state."""
        self._finished = True
        self.release()
        self._consumer.error(error)

    def release(self) -> None:
        """Drop the KV cache and the blocks still to load, and give the cache's buffer back for reuse."""
        self._cache = None
        self._pending_blocks = ()
        if self._buffer is not None and self._buffers is not None:
            self._buffers.give_back(self._buffer)
            self._buffer = None

    def _end_prefill(self, logits: torch.Tensor) -> None:
        if self._decoding is not None:
            self._take(logits)
            return
        self._finished = True
        self.release()
        self._outbox = self._pos - self._start

    def _take(self, logits: torch.Tensor) -> None:
        decoding = self._decoding
        assert decoding is not None, "a prefill-only job never decodes"
        token = decoding.sampler.pick(logits)
        self._tokens.append(token)
        self._generated += 1
        if token in decoding.eos_ids:
            chunk = TokenChunk(token, decoding.text.finish().text, "stop")
        else:
            delta = decoding.text.push(token)
            if delta.stopped:
                chunk = TokenChunk(token, delta.text, "stop")
            elif self._generated >= decoding.max_tokens:
                tail = decoding.text.finish()
                chunk = TokenChunk(token, delta.text + tail.text, "stop" if tail.stopped else "length")
            else:
                chunk = TokenChunk(token, delta.text, None)
        if chunk.finish_reason is not None:
            # The last token is never fed back: its K and V are not needed, so no block covers it.
            self._finished = True
            self.release()
        self._outbox = chunk

    def _hand_back_blocks(self, cache: DynamicCache) -> None:
        size = self._plan.block_size
        complete = self._pos // size
        while self._next_block < complete:
            index = self._next_block
            self._next_block += 1
            # Blocks the caller passed in (including one dropped to recompute the last prompt token) it has already.
            if index < self._plan.known_blocks or self._on_block is None:
                continue
            kv = cut_block(cache, index * size, (index + 1) * size)  # kv: [layers, 2, kv_heads, block, head_dim]
            self._on_block(index, self._tokens[index * size : (index + 1) * size], kv)
