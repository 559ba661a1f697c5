"""A grammar's mask on a request's logits: the tokens it allows keep their logits, every other one (and a model's
padding past the tokenizer's vocabulary) gets -inf."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from prefixgate.backends.grammar import Grammars
from prefixgate.errors import RequestError

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def allowed_by_llguidance(constraint: object) -> set[int]:
    """The tokens llguidance's own mask allows next (bit i of byte k is token 8k + i)."""
    mask = constraint._matcher.compute_bitmask()  # type: ignore[attr-defined]
    return {8 * k + i for k, byte in enumerate(mask) for i in range(8) if byte >> i & 1}


@pytest.mark.parametrize("padding", [0, 40], ids=["the tokenizer's vocabulary", "a padded vocabulary"])
def test_the_tokens_the_grammar_allows_keep_their_logits_and_no_other_does(
    tokenizer: PreTrainedTokenizerFast, padding: int
) -> None:
    constraint = Grammars(tokenizer).compile("start: %json " + json.dumps(SCHEMA))
    vocab = len(tokenizer) + padding
    torch.manual_seed(0)
    for piece in ('{"n', '": 1', ""):  # checked at the start, inside the key, inside the number
        logits = torch.randn(vocab)
        expected = allowed_by_llguidance(constraint)
        assert 0 < len(expected) < len(tokenizer)
        masked = constraint.allowed(logits)
        kept = set(torch.isfinite(masked).nonzero().flatten().tolist())
        assert kept == {token for token in expected if token < vocab}
        assert torch.equal(masked[sorted(kept)], logits[sorted(kept)])  # the allowed keep their logits exactly
        assert all(torch.isneginf(masked[len(tokenizer) :]))  # padding is never allowed
        for token in tokenizer.encode(piece):
            constraint.advance(token)


def test_a_token_the_grammar_cannot_follow_is_refused(tokenizer: PreTrainedTokenizerFast) -> None:
    constraint = Grammars(tokenizer).compile("start: %json " + json.dumps(SCHEMA))
    with pytest.raises(RequestError, match="grammar gave up"):
        constraint.advance(tokenizer.encode("]")[0])
