"""The scheduler: who runs in the next step, and with how many tokens.

Every decoding sequence gets its next token in every step, so running streams keep their pace. Prompts waiting to be
prefilled share a token budget, first come first served, in chunks: the whole `chunk_tokens` when nothing is
decoding, and `interleaved_tokens` beside running streams, so a long prompt delays them by a bounded amount per step
(chunked prefill, as Sarathi-Serve and vLLM schedule it). A model without KV buffers runs one sequence per step,
taking turns.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from prefixgate.backends.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One sequence's share of a step."""

    seq: Sequence
    tokens: int  # the sequence's next prompt chunk, or 1 for its next decoded token


class Scheduler:
    """Plan steps over the running sequences (given oldest first)."""

    def __init__(self, *, chunk_tokens: int, interleaved_tokens: int, packed: bool = True) -> None:
        if chunk_tokens < 1 or interleaved_tokens < 1:
            raise RuntimeError("a step must have room for at least one prompt token")
        self.chunk_tokens = chunk_tokens
        self.interleaved_tokens = interleaved_tokens
        self.packed = packed
        self._turn = 0

    def plan(self, running: Seq[Sequence]) -> list[Scheduled]:
        """Return the next step: every decoding sequence, then prompt chunks within the budget."""
        if not running:
            return []
        if not self.packed:
            self._turn = (self._turn + 1) % len(running)
            seq = running[self._turn]
            # One pass over the whole prompt: such a model's cache cannot be trusted to continue a multi-token step.
            return [Scheduled(seq, seq.prefill_left or 1)]
        plan = [Scheduled(seq, 1) for seq in running if not seq.prefill_left]
        budget = self.interleaved_tokens if plan else self.chunk_tokens
        for seq in running:
            if budget == 0:
                break
            if seq.prefill_left:
                tokens = min(seq.prefill_left, budget)
                plan.append(Scheduled(seq, tokens))
                budget -= tokens
        return plan
