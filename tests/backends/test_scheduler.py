"""The scheduler's budget beside running streams: time, measured, with a prompt token costing more the deeper it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import pytest

from prefixgate.backends.scheduler import STREAM_SLOWDOWN, Scheduled, Scheduler, StepCosts
from prefixgate.backends.sequence import Sequence


@dataclass
class Seq:
    """What the scheduler reads of a sequence."""

    prefill_left: int
    computed: int


def make_scheduler(*, decode: float | None, per_unit: float | None, cap: int = 512) -> Scheduler:
    costs = StepCosts(context_tokens=1000)
    costs.decode_seconds, costs.seconds_per_unit = decode, per_unit
    return Scheduler(chunk_tokens=512, interleaved_tokens=cap, costs=costs)


def plan(scheduler: Scheduler, *seqs: Seq) -> list[tuple[int, bool]]:
    return [(item.tokens, item.prefill) for item in scheduler.plan(cast(list[Sequence], list(seqs)))]


def test_a_chunk_beside_streams_shrinks_with_the_context_it_attends_to() -> None:
    assert STREAM_SLOWDOWN == 3.0
    # A stream's step takes 50 ms and a prompt token 1 ms at the start: (3 - 1) x 50 ms buy 100 units a step.
    scheduler = make_scheduler(decode=0.050, per_unit=0.001)
    stream = Seq(prefill_left=0, computed=50)
    assert plan(scheduler, stream, Seq(5000, computed=0)) == [(1, False), (100, True)]
    assert plan(scheduler, stream, Seq(5000, computed=1000)) == [(1, False), (50, True)]
    assert plan(scheduler, stream, Seq(5000, computed=3000)) == [(1, False), (25, True)]


def test_prompts_share_the_budget_first_come_first_served() -> None:
    scheduler = make_scheduler(decode=0.050, per_unit=0.001)
    stream = Seq(prefill_left=0, computed=50)
    # 30 tokens at the start cost 30 units; the 70 left buy 35 tokens after 1,000 positions.
    assert plan(scheduler, stream, Seq(30, computed=0), Seq(5000, computed=1000)) == [
        (1, False),
        (30, True),
        (35, True),
    ]


def test_a_prompt_too_deep_for_the_budget_still_takes_a_token_a_step() -> None:
    scheduler = make_scheduler(decode=0.050, per_unit=0.001)
    stream = Seq(prefill_left=0, computed=50)
    assert plan(scheduler, stream, Seq(5000, computed=200_000), Seq(10, computed=0)) == [(1, False), (1, True)]


def test_the_interleaved_cap_binds_whatever_the_measures_say() -> None:
    scheduler = make_scheduler(decode=0.040, per_unit=0.0, cap=8)
    assert plan(scheduler, Seq(0, computed=50), Seq(5000, computed=3000)) == [(1, False), (8, True)]


def test_before_any_measure_a_chunk_beside_streams_is_small() -> None:
    scheduler = make_scheduler(decode=None, per_unit=None)
    assert plan(scheduler, Seq(0, computed=50), Seq(5000, computed=0)) == [(1, False), (64, True)]
    assert plan(scheduler, Seq(0, computed=50), Seq(5000, computed=1000)) == [(1, False), (32, True)]


def test_a_prompt_alone_takes_whole_chunks() -> None:
    scheduler = make_scheduler(decode=0.040, per_unit=0.010)
    assert plan(scheduler, Seq(5000, computed=3000)) == [(512, True)]


def test_costs_are_learned_from_the_steps_that_ran() -> None:
    costs = StepCosts(context_tokens=1000)
    stream, prompt = Seq(0, computed=50), Seq(100, computed=1000)
    seqs = cast(list[Sequence], [stream, prompt])
    decode = Scheduled(seqs[0], 1, 50)
    chunk = Scheduled(seqs[1], 100, 1000, prefill=True)
    costs.observe([chunk], 0.4)  # 100 tokens after 1,000 positions: 200 units
    assert costs.seconds_per_unit == pytest.approx(0.002)
    assert costs.decode_seconds is None
    costs.observe([decode], 0.05)
    assert costs.decode_seconds == pytest.approx(0.05)
    # Beside the stream, the chunk's share is what the step took past the stream's own step.
    costs.observe([decode, chunk], 0.05 + 0.2)
    assert costs.seconds_per_unit == pytest.approx(0.7 * 0.002 + 0.3 * 0.001)


def test_the_prefill_rate_comes_from_prompts_computed_from_their_start_and_long_steps_once_one_ran() -> None:
    scheduler = make_scheduler(decode=None, per_unit=None)
    costs = scheduler.costs
    question = Scheduled(cast(Sequence, Seq(20, computed=4000)), 20, 4000, prefill=True)  # after a cached prefix
    costs.observe([question], 0.1)  # 100 units, paying the step's fixed costs for few tokens
    assert costs.seconds_per_prompt_unit is None and scheduler.prefill_seconds(1000) is None
    short = Scheduled(cast(Sequence, Seq(50, computed=0)), 50, 0, prefill=True)  # a short prompt, whole
    costs.observe([short], 0.05)
    assert costs.seconds_per_prompt_unit == pytest.approx(0.001)
    # A long step: what short steps measured goes, as they also paid the step's fixed costs.
    chunk = Scheduled(cast(Sequence, Seq(1000, computed=0)), 512, 0, prefill=True)
    costs.observe([chunk], 0.128)  # 512 units
    assert costs.seconds_per_prompt_unit == pytest.approx(0.00025)
    costs.observe([short], 0.05)
    costs.observe([question], 0.1)
    assert costs.seconds_per_prompt_unit == pytest.approx(0.00025), "short steps no longer count"
    stream = Scheduled(cast(Sequence, Seq(0, computed=50)), 1, 50)
    costs.decode_seconds = 0.05
    costs.observe([stream, chunk], 1.0)
    assert costs.seconds_per_prompt_unit == pytest.approx(0.00025), "nor steps beside streams"
    deep = Scheduled(cast(Sequence, Seq(488, computed=512)), 488, 512, prefill=True)  # 488 x 1.512 units
    costs.observe([deep], 0.00025 * 488 * 1.512)
    assert costs.seconds_per_prompt_unit == pytest.approx(0.00025)
    # 1,000 tokens from the start, in chunks of 512: 512 units, then 488 tokens after 512 positions.
    assert scheduler.prefill_seconds(1000) == pytest.approx(0.00025 * (512 + 488 * 1.512))
    assert scheduler.prefill_seconds(0) == 0.0


def test_the_streams_cost_is_followed_in_steps_beside_prompts() -> None:
    # The streams' step was measured alone when they were few and short (37 ms); now, many on a long prefix, it takes
    # 130 ms, and prompts keep arriving beside them, so no step of them alone comes to measure it again.
    scheduler = make_scheduler(decode=0.037, per_unit=0.002)
    costs = scheduler.costs
    costs.observe([Scheduled(cast(Sequence, Seq(600, computed=0)), 512, 0, prefill=True)], 0.2)  # the prefill rate
    stream, question = Seq(0, computed=7200), Seq(29, computed=7179)  # a question after a 7k-token cached prefix
    chunks = []
    for _ in range(12):
        step = scheduler.plan(cast(list[Sequence], [stream, question]))
        chunks.append(step[-1].tokens)
        units = sum(costs.units(item.tokens, item.context) for item in step if item.prefill)
        costs.observe(step, 0.130 + units * 0.0004)  # what such a step takes: the streams, then the prompt's units
    assert chunks[0] < 29
    assert chunks[-1] == 29, f"the question still goes in a few tokens a step: {chunks}"
    assert costs.decode_seconds == pytest.approx(0.13, rel=0.1)
