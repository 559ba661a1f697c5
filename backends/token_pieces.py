"""Tokenizing rendered chats piece by piece, each piece once: a long system prompt is not tokenized with every request.

A fast tokenizer finds its special tokens in the text first, then tokenizes the text between them piece by piece, each
on its own. So a chat rendered by its template (`<|im_start|>system\n...<|im_end|>...`) tokenizes as its pieces do,
each tokenized after the special token before it, and the ids of every piece are kept by that token and the piece's
text: a request whose system prompt, tools or earlier turns were seen lately tokenizes only its new messages. For a
4k-token system prompt that saves about 4 ms of a core per request (2 cores of an Intel Xeon), and more with longer
prompts.

Pieces split only at special tokens that take no whitespace around them and match their text as written, and the
split is checked once per tokenizer against tokenizing a probe whole; where that fails, texts are tokenized whole.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

import xxhash

DEFAULT_BUDGET_BYTES = 16 << 20  # the most memory kept; pieces used least lately go first
_PIECE_BYTES = 256  # what keeping a piece costs besides its ids (4 bytes each): its key, its array, its dict entry
# Texts between special tokens in the probe: spaces, tabs and newlines at their edges, text that is not ASCII.
_PROBE = ("You are terse.\n\n", " Rules:  one\ttwo  ", "user\n Größe? 東京 \u00a0 x", "\n- a\n- b\n", "  then?  ", "x")


class PieceTokenizer:
    """Tokenize text as `tokenizer` does with no special tokens added, reusing the ids of pieces seen lately.
    Thread-safe."""

    def __init__(self, tokenizer: Any, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._tokenizer = tokenizer
        self._budget = budget_bytes
        specials = [
            added.content
            for added in tokenizer.added_tokens_decoder.values()
            if added.special and not (added.lstrip or added.rstrip or added.single_word or added.normalized)
        ]
        # The longest first where one special token's text starts another's.
        specials.sort(key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._pieces: OrderedDict[int, array[int]] = OrderedDict()  # by the hash of the token before and the piece
        self.nbytes = 0  # what the pieces kept cost
        self._lock = threading.Lock()
        if specials:
            probe = "".join(text + specials[i % len(specials)] for i, text in enumerate(_PROBE)) + _PROBE[0]
            if self(probe) != self._whole(probe):
                self._specials = None

    @property
    def by_pieces(self) -> bool:
        """Say whether texts are tokenized by pieces (else whole)."""
        return self._specials is not None

    def __call__(self, text: str) -> list[int]:
        """Return the token ids of `text`, the special tokens in it recognised, none added."""
        if self._specials is None:
            return self._whole(text)
        # Pieces end after each special token; each after the first is tokenized after the one that ends the piece
        # before it (its id then dropped), as it is inside the whole text.
        pieces: list[tuple[str, str]] = []  # (the special token before, the piece)
        begin, before = 0, ""
        for match in self._specials.finditer(text):
            pieces.append((before, text[begin : match.end()]))
            begin, before = match.end(), match.group()
        if begin < len(text):
            pieces.append((before, text[begin:]))
        keys = [xxhash.xxh3_128_intdigest(f"{len(before)}:{before}{piece}".encode()) for before, piece in pieces]
        with self._lock:
            found = [self._kept(key) for key in keys]
        missing = [index for index, ids in enumerate(found) if ids is None]
        if missing:
            encoded = self._tokenizer([pieces[i][0] + pieces[i][1] for i in missing], add_special_tokens=False)
            with self._lock:
                for index, ids in zip(missing, encoded["input_ids"], strict=True):
                    found[index] = self._keep(keys[index], array("i", ids[1:] if pieces[index][0] else ids))
        token_ids: list[int] = []
        for ids in found:
            assert ids is not None
            token_ids.extend(ids)
        return token_ids

    def _kept(self, key: int) -> array[int] | None:
        ids = self._pieces.get(key)
        if ids is not None:
            self._pieces.move_to_end(key)
        return ids

    def _keep(self, key: int, ids: array[int]) -> array[int]:
        cost = _cost(ids)
        if key not in self._pieces and cost <= self._budget:
            self._pieces[key] = ids
            self.nbytes += cost
            while self.nbytes > self._budget:
                self.nbytes -= _cost(self._pieces.popitem(last=False)[1])
        return ids

    def _whole(self, text: str) -> list[int]:
        return [int(t) for t in self._tokenizer(text, add_special_tokens=False)["input_ids"]]


def _cost(ids: array[int]) -> int:
    return _PIECE_BYTES + ids.itemsize * len(ids)
