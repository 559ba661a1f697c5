"""The scheduler: who runs in the next step, and with how many tokens.

Every decoding sequence gets its next token in every step, so running streams keep their pace. Prompts waiting to be
prefilled share a budget, first come first served, in chunks: the whole `chunk_tokens` when nothing is decoding, and
beside running streams as many as keep the step within `STREAM_SLOWDOWN` times a step of the streams alone, so a long
prompt delays them by a bounded amount per step (chunked prefill, as Sarathi-Serve and vLLM schedule it).

That budget is time, measured (`StepCosts`): what a step of the streams alone has taken lately, and what a prompt
token has cost by the context it attends to. A token deep in a prompt attends to every position before it, so it
costs more than one at the start (SmolLM2 on a CPU: 64 tokens after 8k positions take five times as long as 64 at the
start); counting tokens alone would let late chunks slow the streams several times more than early ones.
`interleaved_tokens` caps a chunk beside streams whatever the measures say. A model without KV buffers runs one
sequence per step, taking turns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from prefixgate.backends.sequence import Sequence

# How many times longer than a step of the running streams alone a step with a prompt chunk beside them may take:
# the streams slow to at most this much of their pace while a prompt is prefilled, and the prompt itself takes about
# STREAM_SLOWDOWN / (STREAM_SLOWDOWN - 1) times its time alone (each step spends the rest on the streams).
STREAM_SLOWDOWN = 3.0
_UNMEASURED_TOKENS = 64  # a chunk beside streams before any step has been measured
_MEMORY = 0.7  # each measure's weight in the next estimate is 1 - this: about the last three steps count


@dataclass(frozen=True, slots=True)
class Scheduled:
    """One sequence's share of a step."""

    seq: Sequence
    tokens: int  # the sequence's next prompt chunk, or 1 for its next decoded token
    context: int = 0  # positions before these tokens, which each of them attends to
    prefill: bool = False  # whether the tokens are the prompt's (else a decoded token)


class StepCosts:
    """What steps have cost lately: one of the decoding streams alone, and a prompt token by its context.

    A prompt token after `context` positions counts as `1 + context / context_tokens` units: `context_tokens` is the
    context at which its attention costs as much as the rest of its layer. Not thread-safe: the worker's thread
    observes and plans.
    """

    def __init__(self, context_tokens: float) -> None:
        if context_tokens <= 0:
            raise RuntimeError(f"context_tokens must be positive, got {context_tokens}")
        self.context_tokens = context_tokens
        self.decode_seconds: float | None = None  # a step of decoding streams alone (see observe)
        self.seconds_per_unit: float | None = None  # a prompt token's share of a step, per unit
        # Seconds and units of the recent prompt-only steps that measure the prefill rate (see
        # seconds_per_prompt_unit), the older weighing less, and whether a long one has.
        self._prefill = (0.0, 0.0, False)

    @property
    def seconds_per_prompt_unit(self) -> float | None:
        """Return what a unit of prompt has cost lately, computed from its start: on prompt-only steps of at least
        `_RATE_TOKENS` tokens once one has run, and before that on those that started prompts at their first token;
        None before any.

        A step also pays fixed costs, such as reading every weight, which a step of a few tokens spreads over few: the
        new question after a cached prefix, a few tokens deep in a long context, cost SmolLM2 on a CPU up to 25 ms a
        unit where computing the 4k prefix cost 0.4, so such steps never count, and short prompts computed whole count
        only until a long step is measured.
        """
        seconds, units, _ = self._prefill  # one tuple, replaced whole: a reader on another thread sees it whole
        return seconds / units if units else None

    def units(self, tokens: int, context: int) -> float:
        """Return what `tokens` prompt tokens after `context` positions cost, in units of a token at the start."""
        return tokens * (1.0 + context / self.context_tokens)

    def tokens_within(self, units: float, context: int) -> int:
        """Return how many prompt tokens after `context` positions cost at most `units`."""
        return int(units / (1.0 + context / self.context_tokens))

    def observe(self, plan: Seq[Scheduled], seconds: float) -> None:
        """Learn from a step that ran `plan` in `seconds`."""
        prompt = [item for item in plan if item.prefill]
        decoding = len(prompt) < len(plan)
        if not prompt:
            self.decode_seconds = _blend(self.decode_seconds, seconds)
            return
        units = sum(self.units(item.tokens, item.context) for item in prompt)
        streams = 0.0  # the streams' share of the step
        if decoding:
            if self.decode_seconds is None:
                return  # the prompt's share is unknown until the streams' own cost is
            streams = self.decode_seconds
        else:
            past_seconds, past_units, had_long = self._prefill
            long = sum(item.tokens for item in prompt) >= _RATE_TOKENS
            if long and not had_long:  # the first long step: what short ones measured goes
                past_seconds = past_units = 0.0
            if long or (not had_long and all(item.context == 0 for item in prompt)):
                self._prefill = (_RATE_MEMORY * past_seconds + seconds, _RATE_MEMORY * past_units + units, long)
        self.seconds_per_unit = _blend(self.seconds_per_unit, max(0.0, seconds - streams) / units)
        rate = self.seconds_per_prompt_unit
        if decoding and rate is not None:
            # The streams change while prompts join them (more of them, deeper into their contexts), and a step of
            # them alone may not come while prompts keep arriving: their share of this step is what is left once the
            # prompt's units are paid at the prefill rate. Without it, 16 streams on a 7k-token prefix that took
            # 130 ms a step were still counted at the 37 ms that few short ones had taken, every prompt token was
            # charged the difference, and each question arriving beside them was prefilled one token a step.
            self.decode_seconds = _blend(self.decode_seconds, max(0.0, seconds - units * rate))


class Scheduler:
    """Plan steps over the running sequences (given oldest first)."""

    def __init__(self, *, chunk_tokens: int, interleaved_tokens: int, costs: StepCosts, packed: bool = True) -> None:
        if chunk_tokens < 1 or interleaved_tokens < 1:
            raise RuntimeError("a step must have room for at least one prompt token")
        self.chunk_tokens = chunk_tokens
        self.interleaved_tokens = interleaved_tokens
        self.costs = costs
        self.packed = packed
        self._turn = 0

    def prefill_seconds(self, tokens: int) -> float | None:
        """Return what computing a prompt's first `tokens` tokens alone would take, in this scheduler's chunks at the
        measured rate (`StepCosts.seconds_per_prompt_unit`); None before a step measured it."""
        rate = self.costs.seconds_per_prompt_unit
        if rate is None:
            return None
        chunks = range(0, tokens, self.chunk_tokens)
        return rate * sum(self.costs.units(min(self.chunk_tokens, tokens - start), start) for start in chunks)

    def plan(self, running: Seq[Sequence]) -> list[Scheduled]:
        """Return the next step: every decoding sequence, then prompt chunks within the budget."""
        if not running:
            return []
        if not self.packed:
            self._turn = (self._turn + 1) % len(running)
            seq = running[self._turn]
            # One pass over the whole prompt: such a model's cache cannot be trusted to continue a multi-token step.
            return [Scheduled(seq, seq.prefill_left or 1, seq.computed, prefill=bool(seq.prefill_left))]
        plan = [Scheduled(seq, 1, seq.computed) for seq in running if not seq.prefill_left]
        budget = self.interleaved_tokens if plan else self.chunk_tokens  # in tokens
        units = self._interleaved_units() if plan else math.inf  # in StepCosts' units
        for seq in running:
            if not seq.prefill_left:
                continue
            tokens = min(seq.prefill_left, budget)
            if units < math.inf:
                tokens = min(tokens, self.costs.tokens_within(units, seq.computed))
            if tokens < 1:
                if any(item.prefill for item in plan):
                    break
                tokens = 1  # one prompt token a step at least, however deep into its prompt
            plan.append(Scheduled(seq, tokens, seq.computed, prefill=True))
            budget -= tokens
            units -= self.costs.units(tokens, seq.computed)
            if budget <= 0 or units <= 0:
                break
        return plan

    def _interleaved_units(self) -> float:
        """Return the prompt units a step beside decoding streams may take, by what steps have cost lately."""
        costs = self.costs
        if costs.decode_seconds is None or costs.seconds_per_unit is None:
            return float(_UNMEASURED_TOKENS)
        if costs.seconds_per_unit == 0.0:
            return math.inf  # prompt tokens have cost nothing measurable: the cap alone binds
        return (STREAM_SLOWDOWN - 1.0) * costs.decode_seconds / costs.seconds_per_unit


_RATE_MEMORY = 0.9  # each prompt-only step's weight in the rate of the next: about the last ten steps count
_RATE_TOKENS = 256  # prompt-only steps this long measure the prefill rate (see seconds_per_prompt_unit)


def _blend(estimate: float | None, measure: float) -> float:
    return measure if estimate is None else _MEMORY * estimate + (1.0 - _MEMORY) * measure
