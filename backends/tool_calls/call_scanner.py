"""The call scanner: read a call body's JSON as the model writes it, far enough to stream each call's arguments.

A call's arguments go out piece by piece, as OpenAI and vLLM stream them, from the moment the body shows that it is
a call: an object where the format puts calls, whose `name` (a string, not empty) came before its arguments (an
object). Until then nothing is sent: a body may still turn out to be text. A call the scanner cannot stream (its
arguments first, or written as a string) is read whole once its body ends. The scanner follows strings and brackets
only; whether the body is valid JSON is the whole body's parse to say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from prefixgate.backends.backend import ToolCallDelta

CallPath = tuple[str, ...]
"""Where a value sits in a body: the keys of the objects around it, `[]` for an array's item (`()`: the body's
top-level values)."""


@dataclass(slots=True)
class _Level:
    """One open object or array, and what is known of it."""

    path: CallPath
    is_object: bool
    key: str | None = None  # an object's key whose value comes next, None while a key is due
    call: int | None = None  # the call this object is, counted in its body, when it sits where calls do
    name: str | None = None  # that call's name, once read


@dataclass(slots=True)
class CallScanner:
    """Scan one call body: `feed` its text as it comes; each call's first piece names it and every piece adds to its
    arguments (compact: white space between JSON tokens left out). `streamed`: the calls whose pieces went out."""

    sites: tuple[CallPath, ...]  # where the format's calls sit
    keys: tuple[str, ...]  # what a call names its arguments
    streamed: set[int] = field(default_factory=set)
    _begun: int = 0  # call objects begun
    _levels: list[_Level] = field(default_factory=list)
    _string: list[str] | None = None  # the string being read, its raw characters, while inside one
    _escaped: bool = False
    _streaming: int | None = None  # the depth of the arguments object being streamed, while inside it
    _call: int = 0  # the call whose arguments those are

    def feed(self, text: str) -> list[ToolCallDelta]:
        """Read more of the body; return the pieces of calls it begins or continues (`index`: the call's place in
        this body)."""
        pieces: list[tuple[int, str | None, list[str]]] = []
        for char in text:
            was = self._streaming
            emitted = self._read(char)
            if self._streaming is not None and was is None:  # an arguments object opened: its call's first piece
                pieces.append((self._call, self._levels[-2].name, []))
            elif emitted and (not pieces or pieces[-1][0] != self._call):
                pieces.append((self._call, None, []))
            if emitted:
                pieces[-1][2].append(char)
        return [ToolCallDelta(index, name=name, arguments="".join(chars)) for index, name, chars in pieces]

    def _read(self, char: str) -> bool:
        """Follow one character; return whether it is part of the arguments being streamed."""
        was = self._streaming
        if self._string is not None:
            self._in_string(char)
            return was is not None
        if char == '"':
            self._string = []
        elif char in "{[":
            self._open(char == "{")
        elif char in "}]":
            if self._levels:
                self._levels.pop()
            if was is not None and len(self._levels) < was:
                self._streaming = None  # the arguments' last bracket goes out with them
        elif char == "," and self._levels and self._levels[-1].is_object:
            self._levels[-1].key = None
        streaming = was is not None or self._streaming is not None
        return streaming and not char.isspace()

    def _in_string(self, char: str) -> None:
        assert self._string is not None
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._string_ends("".join(self._string))
            self._string = None
            return
        self._string.append(char)

    def _string_ends(self, raw: str) -> None:
        level = self._levels[-1] if self._levels else None
        if level is None or not level.is_object:
            return
        if level.key is not None and (level.call is None or level.key != "name"):
            return  # only keys and calls' names are decoded: an argument's text may be long
        try:
            value = json.loads(f'"{raw}"')
        except ValueError:
            value = None
        if level.key is None:
            level.key = value if isinstance(value, str) else ""
        elif isinstance(value, str) and value:
            level.name = value

    def _open(self, is_object: bool) -> None:
        parent = self._levels[-1] if self._levels else None
        if parent is None:
            path: CallPath = ()
        else:
            path = (*parent.path, parent.key or "") if parent.is_object else (*parent.path, "[]")
        level = _Level(path, is_object)
        if (
            is_object
            and self._streaming is None
            and parent is not None
            and parent.call is not None
            and parent.call not in self.streamed
            and parent.name is not None
            and parent.key in self.keys
        ):
            self.streamed.add(parent.call)
            self._call = parent.call
            self._levels.append(level)
            self._streaming = len(self._levels)
            return
        if is_object and path in self.sites and self._streaming is None:
            level.call = self._begun
            self._begun += 1
        self._levels.append(level)
