"""Constrained decoding: a grammar a request's answer must follow, enforced on its own logits at each step.

Grammars are Lark in llguidance's dialect (`start: %json {...}` for JSON valid against a schema). llguidance was
chosen over xgrammar for having no dependencies and Lark with embedded JSON schemas, which tool-call formats need
(a marker, then a call's JSON); both compute SmolLM2's mask in microseconds (measured: 10 us a token for
llguidance, 2 for xgrammar, against tens of milliseconds for a step), so neither costs a step anything noticeable.
"""

from __future__ import annotations

import threading

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from prefixgate.errors import RequestError

# What each byte of a mask adds to its 8 tokens' logits (bit i of byte k is token 8k + i): 0 where the bit is set (the
# token is allowed), -inf where it is clear. One lookup and one addition a step: 58 µs for SmolLM2's 49,152 logits
# against 208 for unpacking the bits and filling with -inf where they are clear (in one process, in turn).
_PENALTIES = torch.where((torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1 == 1, 0.0, float("-inf"))


class Constraint:
    """One request's grammar as it advances: which tokens may come next, and the tokens that came."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """Return float32 `logits` (`[vocab]`, finite) with every token the grammar does not allow next set to -inf."""
        mask = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)  # mask: [vocab / 8]
        penalties = _PENALTIES.index_select(0, mask.int()).flatten()  # penalties: [vocab rounded up to 32]
        vocab = logits.shape[-1]
        if penalties.shape[0] < vocab:  # a model's logits may pad the vocabulary: its padding is never allowed
            penalties = torch.cat([penalties, penalties.new_full((vocab - penalties.shape[0],), float("-inf"))])
        return logits + penalties[:vocab].to(logits.device)

    def advance(self, token: int) -> None:
        """Follow the token picked (one `allowed` let through)."""
        if not self._matcher.consume_token(token):
            # A grammar that let a token through and cannot follow it has met one of llguidance's limits (a pattern
            # such as `^a{1000000}$` builds too many expressions): the schema is too large for it, a fault of the
            # request (a 400, when it happens at the first token, before the answer starts).
            raise RequestError(
                f"the answer cannot be held to this schema (from response_format or the tools of a required or named "
                f"tool_choice): the grammar gave up at token {token}: {_first_line(self._matcher.get_error())}; send "
                "a simpler one"
            )


class Grammars:
    """Compile grammars against one model's tokenizer (its llguidance form is built at the first, about 0.3 s)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._compiled: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def compile(self, grammar: str) -> Constraint:
        """Return a constraint following `grammar`; raise RequestError saying what is wrong with it. Blocking (up to
        a second for a large schema): call it off the event loop."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(
                f"the answer cannot be held to this schema (from response_format or the tools of a required or named "
                f"tool_choice): {_first_line(matcher.get_error())}"
            )
        return Constraint(matcher)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._compiled is None:
                if not isinstance(self._tokenizer, PreTrainedTokenizerFast):
                    raise RequestError(
                        "this model's tokenizer has no fast (Rust) form, which a JSON response_format and a required "
                        "or named tool_choice need"
                    )
                self._compiled = llguidance.hf.from_tokenizer(self._tokenizer)
            return self._compiled


def _first_line(error: str) -> str:
    """Return what llguidance says went wrong, without the grammar and parser state it prints after it."""
    lines = error.strip().splitlines()
    return lines[0][:500] if lines else "no reason given"
