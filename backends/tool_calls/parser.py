"""The tool-call parser: split a model's answer, as it streams, into text and the tool calls it makes.

Each format (one module each) says where a call starts and ends and how its body reads; this machine holds back only
what may still turn out to be a call: text that could begin a start marker, and a call's body until it shows a call
(its name, then its arguments begun; see `call_scanner`), from when its arguments stream. A body that does not read
as calls (text that only looks like one) and sent none goes out as the text it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from prefixgate.backends.backend import ToolCallDelta
from prefixgate.backends.text_stream import held_length
from prefixgate.backends.tool_calls.call_scanner import CallPath, CallScanner


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One whole tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a piece of the answer released: text safe to send, and pieces of tool calls (the first of each call
    names it, with no id; each adds to its arguments)."""

    text: str
    calls: tuple[ToolCallDelta, ...] = ()


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
    sites: tuple[CallPath, ...] = ((),)  # where a body's calls sit: its top-level values, by default
    arguments_keys: tuple[str, ...] = ("arguments",)  # what a call names its arguments


class ToolCallParser:
    """Parse one answer incrementally: `feed` each piece of text as it comes, then `finish` once."""

    def __init__(self, markers: Markers, body: Body) -> None:
        self._markers = markers
        self._body = body
        self._held = ""
        self._scanner: CallScanner | None = None  # the body being read, while in a call
        self._scanned = 0  # how much of the held body the scanner has read
        self._indices: dict[int, int] = {}  # the index each call of the body (by its place in it) went out as
        self._calls = 0  # calls sent: each takes the next index as its first piece goes out
        self._plain = False  # an at-start format whose answer began otherwise: all the rest is text
        self._lead = ""  # the white space before an at-start call

    def feed(self, text: str) -> Parsed:
        """Add a piece of the answer; return what is now safe to send."""
        self._held += text
        out: list[str] = []
        calls: list[ToolCallDelta] = []
        while self._step(out, calls):
            pass
        return Parsed("".join(out), tuple(calls))

    def finish(self) -> Parsed:
        """Return everything still held: a call cut off by the end of the answer (as far as it came, once its
        arguments have begun to stream; else whole if its body reads, or as text)."""
        if self._scanner is None:
            held, self._held = self._held, ""
            return Parsed(held)
        out: list[str] = []
        calls: list[ToolCallDelta] = []
        self._end_call(len(self._held), 0, out, calls)
        return Parsed("".join(out), tuple(calls))

    def _step(self, out: list[str], calls: list[ToolCallDelta]) -> bool:
        """Release what can be released; return whether to look again."""
        start, end = self._markers.start, self._markers.end
        if self._scanner is not None:
            # The end marker cannot begin in what the scanner has read: it was held back while it might.
            at = self._held.find(end, self._scanned) if end is not None else -1
            if at < 0:
                keep = held_length(self._held, (end,)) if end is not None else 0
                self._scan(len(self._held) - keep, calls)  # up to what may begin the end marker
                return False
            self._end_call(at, len(end or ""), out, calls)
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
            self._begin_call()
            return True
        keep = held_length(self._held, (start,))
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
            self._begin_call()
            return True
        self._plain = True
        return True

    def _begin_call(self) -> None:
        markers = self._markers
        self._scanner = CallScanner(markers.sites, markers.arguments_keys)
        self._scanned = 0
        self._indices = {}
        if markers.start_in_body:
            self._scanner.feed(markers.start)

    def _scan(self, upto: int, calls: list[ToolCallDelta]) -> None:
        """Have the scanner read the held body up to `upto`; add the pieces of calls it streams."""
        assert self._scanner is not None
        if upto > self._scanned:
            pieces = self._scanner.feed(self._held[self._scanned : upto])
            calls += (replace(piece, index=self._index(piece.index)) for piece in pieces)
            self._scanned = upto

    def _index(self, place: int) -> int:
        """Return the index of the body's call at `place`: the next one when it is first sent."""
        if place not in self._indices:
            self._indices[place] = self._calls
            self._calls += 1
        return self._indices[place]

    def _end_call(self, at: int, marker: int, out: list[str], calls: list[ToolCallDelta]) -> None:
        """End the body at `at` (its end marker, `marker` characters long, follows; none at the answer's end): the
        calls it streamed stand as they streamed, the others go whole; a body that streamed none and does not read
        as calls goes out as text."""
        self._scan(at, calls)
        scanner, self._scanner = self._scanner, None
        assert scanner is not None
        body = self._call_text(self._held[:at])
        self._held = self._held[at + marker :]
        parsed = self._body(body)
        if parsed is None and not scanner.streamed:
            out.append(self._as_text(body, closed=marker > 0))
            return
        for place, call in enumerate(parsed or ()):
            if place not in scanner.streamed:
                calls.append(ToolCallDelta(self._index(place), name=call.name, arguments=call.arguments))

    def _call_text(self, text: str) -> str:
        return self._markers.start + text if self._markers.start_in_body else text

    def _as_text(self, body: str, *, closed: bool) -> str:
        """Return a body that did not read as calls as the text it came as."""
        markers = self._markers
        opened = body if markers.start_in_body else markers.start + body
        return self._lead + opened + ((markers.end or "") if closed else "")
