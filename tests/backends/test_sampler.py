"""The sampler: greedy picks the maximum, top-k and top-p never pick outside their sets, seeds reproduce."""

from __future__ import annotations

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


def test_a_vanishing_temperature_picks_the_best_without_overflowing() -> None:
    assert set(picks(SamplingParams(temperature=5e-324, seed=0), 5)) == {1}  # 3.0 / 5e-324 would be inf
    assert set(picks(SamplingParams(temperature=1e-30, top_k=3, top_p=0.5, seed=0), 5)) == {1}


def test_top_k_keeps_only_the_k_best() -> None:
    assert set(picks(SamplingParams(temperature=2.0, top_k=2, seed=0))) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Softmax of LOGITS: tokens 1, 2, 3 hold about 0.34, 0.31, 0.28 of the mass; 0.6 needs the first two.
    assert set(picks(SamplingParams(temperature=1.0, top_p=0.6, seed=0))) == {1, 2}


def test_same_seed_same_picks_and_no_seed_still_samples() -> None:
    params = SamplingParams(temperature=1.0, seed=123)
    assert picks(params) == picks(params)
    assert len(set(picks(SamplingParams(temperature=1.0)))) > 1
