"""The sampler: greedy picks the maximum, top-k and top-p never pick outside their sets, seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch

from prefixgate.backends import SamplingParams
from prefixgate.backends.sampler import Sampler

CPU = torch.device("cpu")
LOGITS = torch.tensor([0.0, 3.0, 2.9, 2.8, -1.0, 1.0])  # logits: [vocab=6]


def picks(params: SamplingParams, count: int = 200) -> list[int]:
    sampler = Sampler(params, CPU)
    return [sampler.pick(LOGITS) for _ in range(count)]


def test_temperature_zero_is_greedy() -> None:
    assert set(picks(SamplingParams(temperature=0.0), 5)) == {1}


@pytest.mark.parametrize(
    "logits",
    [[1.0, 3.0, 3.0, 2.0], [1.0, float("nan"), 3.0, float("nan")], [-math.inf, -math.inf, 0.5], [-math.inf] * 3],
    ids=["ties", "NaN", "masked", "all masked"],
)
def test_greedy_picks_what_torch_argmax_picks(logits: list[float]) -> None:
    # the first of equal maxima, and the first NaN where there is one
    scores = torch.tensor(logits)
    assert Sampler(SamplingParams(temperature=0.0), CPU).pick(scores) == int(torch.argmax(scores))


def test_a_vanishing_temperature_picks_the_best_without_overflowing() -> None:
    assert set(picks(SamplingParams(temperature=5e-324, seed=0), 5)) == {1}  # 3.0 / 5e-324 would be inf
    assert set(picks(SamplingParams(temperature=1e-30, top_k=3, top_p=0.5, seed=0), 5)) == {1}


def test_top_k_keeps_only_the_k_best() -> None:
    assert set(picks(SamplingParams(temperature=2.0, top_k=2, seed=0))) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Softmax of LOGITS: tokens 1, 2, 3 hold about 0.34, 0.31, 0.28 of the mass; 0.6 needs the first two.
    assert set(picks(SamplingParams(temperature=1.0, top_p=0.6, seed=0))) == {1, 2}


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=1.0, seed=1), range(6)),
        (SamplingParams(temperature=0.5, seed=2), range(6)),
        (SamplingParams(temperature=2.0, top_k=3, seed=3), (1, 2, 3)),
        (SamplingParams(temperature=1.0, top_p=0.9, seed=4), (1, 2, 3)),  # 0.34 + 0.31 + 0.28 reach 0.9
        (SamplingParams(temperature=1.0, top_k=2, top_p=0.99, seed=5), (1, 2)),
    ],
    ids=["temperature 1", "temperature 0.5", "top-k", "top-p", "top-k and top-p"],
)
def test_tokens_come_as_often_as_their_probability_says(params: SamplingParams, kept: tuple[int, ...]) -> None:
    # The softmax of the kept tokens' logits over the temperature: each token's share of 10,000 picks within 4
    # standard deviations of its probability (a seeded run, so the same every time), and no other token picked.
    count = 10_000
    expected = torch.full_like(LOGITS, float("-inf"))
    expected[list(kept)] = LOGITS[list(kept)] / params.temperature
    probabilities = torch.softmax(expected.double(), dim=-1)
    frequencies = torch.bincount(torch.tensor(picks(params, count)), minlength=len(LOGITS)).double() / count
    margin = 4 * (probabilities * (1 - probabilities) / count).sqrt()
    assert bool(((frequencies - probabilities).abs() <= margin).all()), (frequencies, probabilities)
    assert bool((frequencies[probabilities == 0] == 0).all())


def test_same_seed_same_picks_and_no_seed_still_samples() -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    assert picks(params) == picks(params)
    assert len(set(picks(SamplingParams(temperature=1.0)))) > 1


def test_logit_bias_moves_the_choice_and_minus_100_bans_a_token() -> None:
    assert set(picks(SamplingParams(temperature=0.0, logit_bias=((5, 2.5),)), 3)) == {5}  # 1.0 + 2.5 beats 3.0
    banned = SamplingParams(temperature=1.0, seed=0, logit_bias=((1, -100.0), (2, -100.0)))
    assert not {1, 2} & set(picks(banned))


def test_frequency_penalty_grows_with_each_repeat_and_presence_penalty_counts_once() -> None:
    # Greedy, 0.15 per repeat: 1 (3.0); 2 (2.9 beats 1's 2.85); 1 (2.85 beats 3's 2.8); 3 (2.8 beats 1's 2.7).
    assert picks(SamplingParams(temperature=0.0, frequency_penalty=0.15), 4) == [1, 2, 1, 3]
    # Paid once: 1 (3.0); 2 (2.9 beats 2.85); then 1 keeps 2.85 however often it comes, ahead of 3 (2.8) and 2 (2.75).
    assert picks(SamplingParams(temperature=0.0, presence_penalty=0.15), 5) == [1, 2, 1, 1, 1]


def test_min_tokens_rules_out_the_end_of_turn_until_reached() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0, min_tokens=2), CPU, eos_ids=frozenset({1}))
    assert [sampler.pick(LOGITS) for _ in range(3)] == [2, 2, 1]


def test_logprobs_are_the_models_own_with_the_top_tokens_in_order() -> None:
    sampler = Sampler(
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3), CPU, token_text=lambda t: f"<{t}>"
    )
    expected = torch.log_softmax(LOGITS, dim=-1)
    entry = sampler.logprob(LOGITS, 2)
    assert (entry.token, entry.bytes) == ("<2>", tuple(b"<2>"))
    assert entry.logprob == float(expected[2])
    assert [(top.token, top.logprob) for top in entry.top] == [(f"<{t}>", float(expected[t])) for t in (1, 2, 3)]
