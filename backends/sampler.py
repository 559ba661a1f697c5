"""The sampler: pick the next token from logits, greedily or by temperature, top-k and top-p, after the request's
logit bias, penalties and minimum length; and say how likely the model found each token it picked."""

from __future__ import annotations

from collections.abc import Callable, Set

import torch

from prefixgate.backends.backend import SamplingParams, TokenLogprob, TopLogprob
from prefixgate.backends.grammar import Constraint

TokenText = Callable[[int], str]
"""`token_text(token_id)`: the text of one token alone, as a client is shown it with its log probability."""


class Sampler:
    """Pick tokens for one request; a seeded request always picks the same tokens from the same logits.

    Before picking, the logits take the request's `logit_bias`, then lose `frequency_penalty` for each time a token
    was generated before and `presence_penalty` once if it was (as OpenAI and vLLM count them: generated tokens only),
    a `constraint` leaves only the tokens its grammar allows, and the end-of-turn tokens are ruled out until
    `min_tokens` are generated (unless the grammar allows nothing else). Log probabilities are the model's own,
    before any of that (as vLLM reports them by default), so they say how likely the model found the token.
    """

    def __init__(
        self,
        params: SamplingParams,
        device: torch.device,
        *,
        eos_ids: Set[int] = frozenset(),
        token_text: TokenText = str,
        constraint: Constraint | None = None,
    ) -> None:
        self._params = params
        self._constraint = constraint
        self._eos_ids = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self._token_text = token_text
        self._generated = 0
        self._bias: torch.Tensor | None = None  # bias: [vocab], built at the first pick, when the vocabulary is known
        # What frequency and presence penalties take off each logit, [vocab], built at the first pick where they apply,
        # and how many times each token was generated: one subtraction a pick (a greedy pick with both penalties takes
        # 46 µs for SmolLM2's vocabulary, against 168 working them out from the counts at every pick).
        self._penalties: torch.Tensor | None = None
        self._counts: dict[int, int] = {}
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
        token = self._choose(self._processed(logits))
        self._generated += 1
        if self._penalties is not None:
            count = self._counts[token] = self._counts.get(token, 0) + 1
            self._penalties[token] = self._params.frequency_penalty * count + self._params.presence_penalty
        if self._constraint is not None:
            self._constraint.advance(token)
        return token

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """Return the log probability of `token` under `logits` (`[vocab]`), with the request's `top_logprobs` most
        likely tokens."""
        (entry,) = self.logprobs(logits.unsqueeze(0), [token], self._params.top_logprobs)
        return entry

    def logprobs(self, logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
        """Return the log probability of each of `tokens` under its row of `logits` (`[rows, vocab]`), and its rank
        (1 + the tokens more likely), with the `top` most likely tokens of the row (ranked 1 to `top`)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # logprobs: [rows, vocab]
        chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device).unsqueeze(-1))  # chosen: [rows, 1]
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        values, ids = torch.topk(logprobs, top) if top else (logprobs[:, :0], logprobs[:, :0].long())
        entries = []
        rows = zip(tokens, chosen.squeeze(-1).tolist(), ranks, ids.tolist(), values.tolist(), strict=True)
        for token, logprob, rank, row_ids, row_values in rows:
            best = tuple(self._entry(i, v, r) for r, (i, v) in enumerate(zip(row_ids, row_values, strict=True), 1))
            entry = self._entry(token, logprob, rank)
            entries.append(TokenLogprob(entry.token, entry.logprob, entry.bytes, best, token, rank))
        return entries

    def unscored(self, token: int) -> TokenLogprob:
        """Return the entry of a token that has no log probability: a prompt's first, with nothing before it."""
        entry = self._entry(token, 0.0)
        return TokenLogprob(entry.token, None, entry.bytes, token_id=token)

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        params = self._params
        if params.logit_bias:
            if self._bias is None:
                self._bias = torch.zeros_like(logits, dtype=torch.float32)
                for token, bias in params.logit_bias:
                    self._bias[token] = bias
            logits = logits + self._bias
        if params.frequency_penalty or params.presence_penalty:
            if self._penalties is None:
                self._penalties = torch.zeros_like(logits, dtype=torch.float32)
            logits = logits - self._penalties
        if self._constraint is not None:
            logits = self._constraint.allowed(logits)
        if self._generated < params.min_tokens and self._eos_ids.numel():
            ended = logits.index_fill(-1, self._eos_ids, float("-inf"))
            # A grammar that is complete allows nothing but the end: it wins over min_tokens.
            logits = ended if bool(torch.isfinite(ended).any()) else logits
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        if self._generator is None:
            return _argmax(logits)
        # In float64, where a tiny temperature is not 0, and shifted so the best scores 0: however small the
        # temperature, no score overflows to +inf, whose exponential would make the weights nan.
        logits = logits.double()
        scores = (logits - logits.max()) / self._params.temperature  # scores: [vocab]
        top_k, top_p = self._params.top_k, self._params.top_p
        tokens = None  # the candidates' token ids, where top-k or top-p narrowed them: [candidates]
        if 0 < top_k < scores.shape[-1]:
            kth = torch.topk(scores, top_k).values[-1]
            tokens = (scores >= kth).nonzero().flatten()  # the k best, and any tied with the k-th
            scores = scores[tokens]
        if top_p < 1.0:
            probs = torch.exp(scores)  # the best scores 0: no overflow (softmax itself takes a fifth longer here)
            probs /= probs.sum()
            ranked = _most_likely(probs, top_p)  # ranked: [most likely first]
            probs = probs[ranked]
            # Drop a token when the tokens ranked above it already reach top_p; the first one always stays.
            ranked = ranked[(torch.cumsum(probs, dim=-1) - probs) < top_p]
            scores = scores[ranked]
            tokens = ranked if tokens is None else tokens[ranked]
        # One draw from the candidates' weights, by where a uniform number in (0, total] falls among their running
        # sums (a candidate of weight 0, a token ruled out, is never where it falls).
        total = torch.cumsum(torch.exp(scores), dim=-1)
        uniform = torch.rand((), dtype=torch.float64, device=total.device, generator=self._generator)  # in [0, 1)
        draw = (1.0 - uniform) * total[-1]
        chosen = int(torch.searchsorted(total, draw))
        return chosen if tokens is None else int(tokens[chosen])

    def _entry(self, token: int, logprob: float, rank: int | None = None) -> TopLogprob:
        text = self._token_text(token)
        return TopLogprob(text, logprob, tuple(text.encode("utf-8", errors="replace")), token, rank)


def _argmax(logits: torch.Tensor) -> int:
    """Return the index of the largest of `logits` (`[vocab]`), the first of equals (and the first NaN where there is
    one), as `torch.argmax` does. On a CPU numpy's does it in 5 µs for SmolLM2's 49,152 logits against 56 to 155 for
    torch's, once a step for each greedy stream."""
    if logits.device.type == "cpu":
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits).item())


def _most_likely(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Return the indices of the most likely of `probs`, most likely first, enough of them to reach `top_p` (all of
    them where they do not): found among the best 64, then 8 times as many, before sorting all of them. Sorting
    SmolLM2's 49,152 took 4 to 5 ms a token; the best 64 take about 0.1."""
    count = min(64, probs.shape[-1])
    while True:
        values, indices = torch.topk(probs, count)
        if count == probs.shape[-1] or float(values.sum()) >= top_p:
            return indices
        count = min(count * 8, probs.shape[-1])
