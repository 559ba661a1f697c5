"""The text stream: turn generated token ids into stable text, cut at the first stop string."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Prompt tokens decoded ahead of the generated ones: tokenizers that drop a leading space when a word starts the
# decoded text (SentencePiece) then render the first generated word as they would mid-sentence.
_CONTEXT_TOKENS = 6
_INCOMPLETE = "\ufffd"  # what a decoder shows for the first bytes of a multi-byte character


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text that became stable with one token, and the stop string that ended the stream there, if one did."""

    text: str
    stop: str | None


class TextStream:
    """Decode one request's generated tokens incrementally; never release text that belongs to a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        # Decoding every generated token each step would cost O(n^2); instead decode only the tokens since the last
        # stable point (the window [prefix, ...)), and compare with the window's text up to `read`.
        self._prefix = 0
        self._read = len(self._tokens)
        self._held = ""  # stable text kept back because it could be the start of a stop string

    def push(self, token_id: int) -> TextDelta:
        """Add one generated token; return the text that is now safe to send."""
        self._tokens.append(token_id)
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        # A trailing U+FFFD means a multi-byte character is still incomplete: wait for its remaining tokens.
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return self._release("", final=False)
        self._prefix, self._read = self._read, len(self._tokens)
        return self._release(after[len(before) :], final=False)

    def finish(self) -> TextDelta:
        """Flush everything still pending (held text, an incomplete character) at the end of generation."""
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return self._release(after[len(before) :], final=True)

    def _release(self, new_text: str, *, final: bool) -> TextDelta:
        text = self._held + new_text
        found = [(at, stop) for stop in self._stop if (at := text.find(stop)) >= 0]
        if found:
            cut, stop = min(found)  # the first to occur
            self._held = ""
            return TextDelta(text[:cut], stop)
        keep = 0 if final else held_length(text, self._stop)
        self._held = text[len(text) - keep :] if keep else ""
        return TextDelta(text[: len(text) - keep], None)


def held_length(text: str, stop: Sequence[str]) -> int:
    """Return the length of the longest end of `text` that some of `stop` starts with: what to hold back, as it may
    become one of them."""
    if not text:
        return 0
    last = text[-1]
    longest = 0
    for s in stop:
        k = min(len(s) - 1, len(text))
        while k > longest:
            # Only a start of `s` that ends in the text's last character can be the text's end: jump to the next one
            # rather than compare every length, which made a long stop string cost its length squared per token.
            k = s.rfind(last, 0, k) + 1
            if k <= longest:
                break
            if text.endswith(s[:k]):
                longest = k
                break
            k -= 1
    return longest
