"""The tool-call parser: split a model's answer, as it streams, into text and the tool calls it makes.

Each format (one module each) says where a call starts and ends and how its body reads; this machine holds back only
what may still turn out to be a call: text that could begin a start marker, and a call until its end. A body that
does not read as calls (text that only looks like one) goes out as the text it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One whole tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a piece of the answer released: text safe to send, and the calls completed in it."""

    text: str
    calls: tuple[ParsedCall, ...] = ()


Body = Callable[[str], list[ParsedCall] | None]
"""`body(text)`: the calls a call's text holds, or None when it does not read as calls."""


@dataclass(frozen=True, slots=True)
class Markers:
    """Where a format's calls are: after `start` (anywhere in the answer, or only at its beginning, past white
    space), up to `end` (or the answer's end); `start` is part of the body when `start_in_body` (a call that is
    plain JSON starts with its `{`)."""

    start: str
    end: str | None = None
    anywhere: bool = True
    start_in_body: bool = False


class ToolCallParser:
    """Parse one answer incrementally: `feed` each piece of text as it comes, then `finish` once."""

    def __init__(self, markers: Markers, body: Body) -> None:
        self._markers = markers
        self._body = body
        self._held = ""
        self._in_call = False
        self._plain = False  # an at-start format whose answer began otherwise: all the rest is text
        self._lead = ""  # the white space before an at-start call

    def feed(self, text: str) -> Parsed:
        """Add a piece of the answer; return what is now safe to send."""
        self._held += text
        out: list[str] = []
        calls: list[ParsedCall] = []
        while self._step(out, calls):
            pass
        return Parsed("".join(out), tuple(calls))

    def finish(self) -> Parsed:
        """Return everything still held: a call cut off by the end of the answer, if its body reads, else text."""
        held, self._held = self._held, ""
        if not self._in_call:
            return Parsed(held)
        self._in_call = False
        body = self._call_text(held)
        parsed = self._body(body)
        return Parsed(self._as_text(body, closed=False)) if parsed is None else Parsed("", tuple(parsed))

    def _step(self, out: list[str], calls: list[ParsedCall]) -> bool:
        """Release what can be released; return whether to look again."""
        start, end = self._markers.start, self._markers.end
        if self._in_call:
            if end is None:
                return False  # up to the answer's end
            at = self._held.find(end)
            if at < 0:
                return False
            body = self._call_text(self._held[:at])
            self._held = self._held[at + len(end) :]
            self._in_call = False
            parsed = self._body(body)
            if parsed is None:
                out.append(self._as_text(body, closed=True))
            else:
                calls += parsed
            return True
        if self._plain:
            out.append(self._held)
            self._held = ""
            return False
        if not self._markers.anywhere:
            return self._at_start(out)
        at = self._held.find(start)
        if at >= 0:
            out.append(self._held[:at])
            self._held = self._held[at + len(start) :]
            self._in_call = True
            return True
        keep = _marker_prefix(self._held, start)
        out.append(self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]
        return False

    def _at_start(self, out: list[str]) -> bool:
        start = self._markers.start
        begun = self._held.lstrip()
        if not begun or start.startswith(begun):
            return False  # nothing but white space yet, or the marker's first characters: wait
        if begun.startswith(start):
            self._lead = self._held[: len(self._held) - len(begun)]  # given back with the body if it is no call
            self._held = begun[len(start) :]
            self._in_call = True
            return True
        self._plain = True
        return True

    def _call_text(self, text: str) -> str:
        return self._markers.start + text if self._markers.start_in_body else text

    def _as_text(self, body: str, *, closed: bool) -> str:
        """Return a body that did not read as calls as the text it came as."""
        markers = self._markers
        opened = body if markers.start_in_body else markers.start + body
        return self._lead + opened + ((markers.end or "") if closed else "")


def _marker_prefix(text: str, marker: str) -> int:
    """Return the length of the longest end of `text` that begins `marker` (held back: it may become one)."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
