"""The sequence: the state of one request on the model thread, from its cached prefix to its last token.

A sequence never calls the model. Each step the scheduler gives it a number of tokens, the runner computes them with
the rest of the step, and the sequence takes the result: it advances, hands back each block it completed, and picks
its next token from the logits when it has reached the end of its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
from transformers import DynamicCache

from prefixgate.backends.backend import BlockCallback, FinishReason, TokenChunk, TokenLogprob
from prefixgate.backends.kv_buffers import KVReservation
from prefixgate.backends.sampler import Sampler
from prefixgate.backends.text_stream import TextStream

StepKind = Literal["prefill", "decode"]


class Consumer(Protocol):
    """Where a sequence's results go; each call returns False once nobody is listening any more."""

    def token(self, chunk: TokenChunk) -> bool:
        """Deliver one generated token."""
        ...

    def prefilled(self, tokens: int) -> bool:
        """Deliver the end of a prefill-only request and how many tokens it computed."""
        ...

    def error(self, error: BaseException) -> None:
        """Deliver the error that ended the request."""
        ...


@dataclass(frozen=True, slots=True)
class Decoding:
    """What a sequence needs to generate after its prefill: how to pick tokens, render text and stop."""

    sampler: Sampler
    text: TextStream
    eos_ids: frozenset[int]  # the tokens that end the answer (none with ignore_eos)
    max_tokens: int
    logprobs: bool = False  # each token comes with its log probability
    prompt_logprobs: int | None = None  # the prompt's tokens' too, with this many alternatives (all of it computed)


@dataclass(frozen=True, slots=True)
class SequencePlan:
    """What to compute: the prompt, the cached blocks to start from, and where prefill ends."""

    prompt: Seq[int]
    cached_blocks: Seq[torch.Tensor]  # the blocks to load (the last may be partial); already checked and trimmed
    known_blocks: int  # whole blocks the caller already has (passed in), never handed back again
    prefill_end: int  # prompt tokens to have in the cache when prefill ends
    block_size: int
    shared: int = 0  # leading positions read from shared prefixes (the memory's offset); cached_blocks follow them
    prompt_tail: bool = False  # hand back the prompt's partial last block as soon as it is computed


class Sequence:
    """Prefill a prompt from cached blocks, then decode (or stop, for a prefill-only request)."""

    def __init__(
        self,
        seq_id: int,
        plan: SequencePlan,
        memory: KVReservation,
        consumer: Consumer,
        *,
        decoding: Decoding | None,
        on_block: BlockCallback | None,
    ) -> None:
        self.seq_id = seq_id
        self.tokens = list(plan.prompt)  # prompt, then each generated token as it is picked
        self.memory = memory
        self._plan = plan
        self._consumer = consumer
        self._decoding = decoding
        self._on_block = on_block
        self._pending_blocks: Seq[torch.Tensor] = plan.cached_blocks
        assert plan.shared == memory.offset, "the plan was made for the memory's shared prefixes"
        self.start = plan.shared + sum(block.shape[3] for block in plan.cached_blocks)  # tokens served from the cache
        self.computed = self.start  # tokens whose K and V are in the cache
        self._next_block = self.start // plan.block_size  # a partial block is completed here, and handed back
        # transformers' own cache, for a model without KV buffers (it runs alone, a whole prompt in one pass).
        self.cache: DynamicCache | None = None
        self._generated = 0
        self._outbox: TokenChunk | int | None = None  # the last step's result, until publish()
        self._finished = False
        self._cancelled = False
        # The prompt's log probabilities so far, where asked for, until the first token carries them
        self._prompt_logprobs: list[TokenLogprob] | None = None
        if decoding is not None and decoding.prompt_logprobs is not None:
            assert self.start == 0, "a prompt's log probabilities need its whole prompt computed"
            self._prompt_logprobs = [decoding.sampler.unscored(self.tokens[0])]  # nothing before it

    @property
    def finished(self) -> bool:
        """Say whether the sequence has nothing left to run."""
        return self._finished

    @property
    def cancelled(self) -> bool:
        """Say whether the sequence's consumer has gone."""
        return self._cancelled

    @property
    def every_logit(self) -> bool:
        """Say whether the next step gives the logits of every token fed, not only of the last (while it computes a
        prompt whose log probabilities were asked for)."""
        return self._prompt_logprobs is not None and self.computed < self._plan.prefill_end

    @property
    def prefill_left(self) -> int:
        """Return the prompt tokens still to compute (0 once decoding)."""
        return max(0, self._plan.prefill_end - self.computed)

    def cancel(self) -> None:
        """Ask the model thread to drop this sequence before its next step (safe from any thread)."""
        self._cancelled = True

    def feed(self, tokens: int) -> Seq[int]:
        """Return the next `tokens` token ids to compute, making room for them in the cache first."""
        if self.memory.buffer is not None:
            if self._pending_blocks:
                self.memory.load(self._pending_blocks)
                self._pending_blocks = ()
            self.memory.ensure(self.computed + tokens, self.computed)
        assert self.computed + tokens <= len(self.tokens), "a sequence computes only tokens it has"
        return self.tokens[self.computed : self.computed + tokens]

    def advance(self, tokens: int, logits: torch.Tensor) -> StepKind:
        """Take a step's result: `tokens` more in the cache, and the last one's logits (`[1, vocab]`), or every one's
        (`[tokens, vocab]`) where the step was asked for them (`every_logit`)."""
        kind: StepKind = "prefill" if self.computed < self._plan.prefill_end else "decode"
        if self.every_logit:
            self._score_prompt(logits)
        self.computed += tokens
        self._hand_back_blocks()
        if kind == "decode":
            self._take(logits[-1])
        elif self.computed == self._plan.prefill_end:
            self._end_prefill(logits[-1])
        return kind

    def _score_prompt(self, logits: torch.Tensor) -> None:
        """Add the log probability of each prompt token that follows one fed this step, under its logits."""
        decoding, scored = self._decoding, self._prompt_logprobs
        assert decoding is not None and decoding.prompt_logprobs is not None and scored is not None
        following = self.tokens[self.computed + 1 : min(self.computed + logits.shape[0] + 1, self._plan.prefill_end)]
        if following:
            scored.extend(decoding.sampler.logprobs(logits[: len(following)], following, decoding.prompt_logprobs))

    def publish(self) -> None:
        """Deliver the last step's token (or prefill count) to the consumer; a gone consumer cancels the sequence."""
        item, self._outbox = self._outbox, None
        if item is None:
            return
        delivered = self._consumer.token(item) if isinstance(item, TokenChunk) else self._consumer.prefilled(item)
        if not delivered:
            self._cancelled = True

    def fail(self, error: BaseException) -> None:
        """Deliver an error to the consumer and drop the sequence's state."""
        self._finished = True
        self.release()
        self._consumer.error(error)

    def release(self) -> None:
        """Drop the cache and the blocks still to load, and give the KV memory back."""
        self.cache = None
        self._pending_blocks = ()
        self.memory.release()

    def _end_prefill(self, logits: torch.Tensor) -> None:
        if self._decoding is not None:
            if self._plan.prompt_tail:
                self._hand_back_tail()  # before the first token: whoever it lets go on finds the tail filed
            self._take(logits)
            return
        self._finished = True
        self.release()
        self._outbox = self.computed - self.start

    def _take(self, logits: torch.Tensor) -> None:
        decoding = self._decoding
        assert decoding is not None, "a prefill-only sequence never decodes"
        token = decoding.sampler.pick(logits)
        logprobs = (decoding.sampler.logprob(logits, token),) if decoding.logprobs else ()
        self.tokens.append(token)
        self._generated += 1
        if token in decoding.eos_ids:
            chunk = TokenChunk(token, decoding.text.finish().text, "stop", logprobs=logprobs)
        else:
            delta = decoding.text.push(token)
            if delta.stop is not None:
                chunk = TokenChunk(token, delta.text, "stop", delta.stop, logprobs=logprobs)
            elif self._generated >= decoding.max_tokens:
                tail = decoding.text.finish()
                reason: FinishReason = "length" if tail.stop is None else "stop"
                chunk = TokenChunk(token, delta.text + tail.text, reason, tail.stop, logprobs=logprobs)
            else:
                chunk = TokenChunk(token, delta.text, None, logprobs=logprobs)
        if self._prompt_logprobs is not None:  # the first token carries them
            chunk = replace(chunk, prompt_logprobs=tuple(self._prompt_logprobs))
            self._prompt_logprobs = None
        if chunk.finish_reason is not None:
            # The last token is never fed back: its K and V are not needed, so no block covers it.
            self._finished = True
            self._hand_back_tail()
            self.release()
        self._outbox = chunk

    def _hand_back_tail(self) -> None:
        """Hand back the incomplete last block (a tail), for a follow-up prompt (or the same one) to reuse to the
        token."""
        size = self._plan.block_size
        index, filled = divmod(self.computed, size)
        buffer = self.memory.buffer
        if self._on_block is None or buffer is None or not filled:
            return
        first = index * size - self.memory.offset  # the buffer starts at the memory's offset
        with torch.inference_mode(False):
            kv = buffer.new_zeros((*buffer.shape[:3], size, buffer.shape[4]))  # kv: [layers, 2, kv_heads, block, hd]
            kv[:, :, :, :filled] = buffer[:, :, :, first : first + filled]
        self._on_block(index, self.tokens[index * size : self.computed], kv)

    def _hand_back_blocks(self) -> None:
        size = self._plan.block_size
        complete = self.computed // size
        while self._next_block < complete:
            index = self._next_block
            self._next_block += 1
            # Blocks the caller passed in (including one dropped to recompute the last prompt token) it has already.
            if index < self._plan.known_blocks or self._on_block is None:
                continue
            buffer = self.memory.buffer
            assert buffer is not None, "only a model with KV buffers hands back blocks"
            # Outside inference mode the copy is an ordinary tensor, which a store may later write to in place; an
            # inference tensor would refuse that. The copy is never a view into the live cache.
            first = index * size - self.memory.offset  # the buffer starts at the memory's offset
            with torch.inference_mode(False):
                kv = buffer[:, :, :, first : first + size].clone()  # kv: [layers, 2, kv_heads, block, hd]
            self._on_block(index, self.tokens[index * size : (index + 1) * size], kv)
