"""The sampler: pick the next token from logits, greedily or by temperature, top-k and top-p."""

from __future__ import annotations

import torch

from prefixgate.backends.backend import SamplingParams


class Sampler:
    """Pick tokens for one request; a seeded request always picks the same tokens from the same logits."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self._temperature = params.temperature
        self._top_k = params.top_k
        self._top_p = params.top_p
        # One generator per request, so a seeded request is reproducible whatever else the worker runs.
        self._generator: torch.Generator | None = None
        if params.temperature > 0:
            self._generator = torch.Generator(device=device)
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """Return the next token id from the last position's logits (`[vocab]`)."""
        if self._generator is None:
            return int(torch.argmax(logits).item())
        # In float64, where a tiny temperature is not 0, and shifted so the best scores 0: however small the
        # temperature, no score overflows to +inf, which softmax would turn into nan.
        logits = logits.double()
        scores = (logits - logits.max()) / self._temperature  # scores: [vocab]
        if 0 < self._top_k < scores.shape[-1]:
            kth = torch.topk(scores, self._top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self._top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)  # sorted: [vocab]
            probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= self._top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)  # drop: [vocab]
            scores = scores.masked_fill(drop, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # probs: [vocab]
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
