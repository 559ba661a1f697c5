"""Layout: static before dynamic. Values that change per request move out of the static prefix to the prompt's end.

A date, time, UUID or request id inside a system or developer message makes every request's prefix unique, so no
two requests share KV blocks past it. `lay_out` replaces each such value with a placeholder that does not depend
on the value (`[date 1]`) and appends the values to the last user message, where the model still reads them and
where the prompt differs per request anyway. Patterns are a setting; `DEFAULT_PATTERNS` covers the usual ones.

Every default pattern takes time linear in the text, however adversarial (`benchmarks/prepare_bench.py`). A custom
pattern runs as written: one with two quantified runs that can match the same characters, before something that may
fail, can take quadratic time or worse on a long prompt.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from prefixgate.errors import DynamicPatternError

STATIC_ROLES = frozenset({"system", "developer"})
"""Roles whose content forms the shared, static prefix that layout keeps free of per-request values."""

BLOCK_INTRO = "(Values of the placeholders in the system prompt: "
"""Start of the block appended to the last user message; the values follow as `[date 1] = 2026-11-29; ...`."""


@dataclass(frozen=True, slots=True)
class DynamicPattern:
    """Name a regex for content that changes per request; a group named `value` narrows what moves."""

    name: str
    regex: str
    compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Names appear in placeholders and in an HTTP header, so they stay plain ASCII identifiers.
        if not _NAME.fullmatch(self.name):
            raise DynamicPatternError(
                f"dynamic pattern name {self.name!r} must start with a letter and hold only ASCII letters, digits "
                "and underscores"
            )
        try:
            compiled = re.compile(self.regex)
        except re.error as exc:
            raise DynamicPatternError(f"dynamic pattern {self.name!r} does not compile: {exc}; fix its regex") from None
        if compiled.fullmatch(""):
            raise DynamicPatternError(
                f"dynamic pattern {self.name!r} matches empty text, which would insert placeholders everywhere; "
                "make its regex require at least one character"
            )
        object.__setattr__(self, "compiled", compiled)


_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

# Building blocks of the default patterns. Years are limited to 1900-2099 and months and days to their ranges, so
# version numbers ("3.11.7"), prices ("$14.05"), ratios ("16:9") and plain numbers stay where they are.
_YEAR_DIGITS = r"(?:19|20)\d{2}"
_YEAR = rf"{_YEAR_DIGITS}(?!\d)"
_MONTH_NUM = r"(?:0?[1-9]|1[0-2])"
_DAY_NUM = r"(?:0?[1-9]|[12]\d|3[01])"
_ISO_DATE = rf"{_YEAR_DIGITS}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
_MONTH = (
    r"(?i:(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?"
    r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\b\.?)"
)
_WEEKDAY = (
    r"(?i:(?:monday|tuesday|wednesday|thursday|friday|saturday|sunday|mon|tues?|wed|thu(?:rs?)?|fri|sat|sun)\b\.?)"
)
_DAY = r"(?<!\d)(?:0?[1-9]|[12]\d|3[01])(?i:st|nd|rd|th)?\b"
_MONTH_DAY = rf"{_MONTH}\s+{_DAY}"
_DAY_MONTH = rf"(?i:the\s+)?{_DAY}\s+(?i:of\s+)?{_MONTH}"
_ZONE = r"(?:\s?(?:UTC|GMT)\b|Z\b|[+-](?:[01]\d|2[0-3]):?[0-5]\d)"
_CLOCK = r"(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d(?:[.,]\d{1,9})?)?"
# Between a label and its value. The spaces before the separator are inside its optional group, and both runs are
# possessive: two plain `\s*` around an optional separator can split one run of spaces in n ways, and would try all
# of them (quadratic) before a value that is not there fails.
_LABEL_SEP = r"[\"']?(?:\s*+(?:[:=#]|\bis\b))?\s*+[\"']?"
# A labeled id: 4 to 128 characters from the first letter or digit after the label to the last ASCII letter or
# digit of that run of id characters, with a digit among them. The run is scanned at most 128 characters ahead:
# an unbounded scan let labels chained inside one long token ("request_id:request_id:...") each rescan the rest of
# it, quadratic in its length. A longer run is no id this pattern knows, and stays where it is.
_ID_LENGTH = 128
_ID_VALUE = (
    rf"(?=[A-Za-z0-9])(?=[\w.:-]{{0,{_ID_LENGTH - 1}}}?\d)[A-Za-z0-9][\w.:-]{{2,{_ID_LENGTH - 2}}}[A-Za-z0-9]"
    # what is left of the run holds no ASCII letter or digit: the value took all of them
    r"(?=(?:[^\W0-9A-Za-z]|[.:-])*+(?![\w.:-]))"
)

DEFAULT_PATTERNS: tuple[DynamicPattern, ...] = (
    # ISO-8601 datetimes, extended ("2026-11-29T14:05:33.120+01:00", "2026-11-29 14:05Z") and basic forms.
    DynamicPattern("datetime", rf"(?<!\d){_ISO_DATE}[T ]{_CLOCK}{_ZONE}?(?!\d)"),
    DynamicPattern("datetime", rf"(?<!\d){_YEAR_DIGITS}\d{{4}}T\d{{4}}(?:\d{{2}})?(?:Z\b|[+-]\d{{2}}:?\d{{2}})?(?!\d)"),
    DynamicPattern("date", rf"(?<!\d){_ISO_DATE}(?!\d)"),
    # "2026/11/29", and "11/29/2026" or "29.11.2026": the same separator twice, a four-digit year.
    DynamicPattern("date", rf"(?<![\d/.]){_YEAR_DIGITS}/{_MONTH_NUM}/{_DAY_NUM}(?![\d/]|\.\d)"),
    DynamicPattern("date", rf"(?<![\d/.]){_DAY_NUM}(?P<sep>[/.]){_DAY_NUM}(?P=sep){_YEAR}(?![/.]\d)"),
    # "November 29, 2026", "Sunday, Nov. 29th 2026", "29 Nov 2026", "Sunday, the 29th of November 2026".
    DynamicPattern("date", rf"\b(?:{_WEEKDAY},?\s+)?{_MONTH_DAY},?\s+{_YEAR}"),
    DynamicPattern("date", rf"\b(?:{_WEEKDAY},?\s+)?{_DAY_MONTH},?\s+{_YEAR}"),
    # Without a year only after a weekday ("Sunday, November 29"): "May 5" alone is too often not a date.
    DynamicPattern("date", rf"\b{_WEEKDAY},?\s+(?:{_MONTH_DAY}|{_DAY_MONTH})"),
    # "14:05", "14:05:33", "2:05 PM", "14:05 UTC"; a colon, dot or letter just before means a port or an address.
    DynamicPattern("time", rf"(?<![\w:.]){_CLOCK}(?:\s?(?:[AaPp][Mm]\b|[AaPp]\.[Mm]\.))?{_ZONE}?(?![\d:])"),
    DynamicPattern("uuid", r"(?i:(?<![0-9a-f-])[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}(?![0-9a-f-]))"),
    # Labeled ids ("request id: abc123", "request_id=...", "X-Request-ID: ..."): only the value moves, the label
    # stays; the value needs a digit, so "the request id is optional" stays as written.
    DynamicPattern(
        "request_id",
        rf"(?i:\b(?:x-)?(?:request|req|trace|correlation|session)[ _-]?id\b){_LABEL_SEP}(?P<value>{_ID_VALUE})",
    ),
    # Prefixed ids ("req_8f3a91c2", "chatcmpl-9x8Y7z6W"), again only with a digit, so "req_timeout" stays.
    DynamicPattern(
        "request_id", r"(?<![\w-])(?:req|request|trace|span|chatcmpl)[_-](?=[A-Za-z]*\d)[A-Za-z0-9]{6,}(?![\w-])"
    ),
    # Unix epoch seconds (10 digits, optionally as ms, us or ns) only after a label: a bare number may be anything.
    DynamicPattern(
        "timestamp",
        r"(?i:\b(?:[a-z]+[_-])?(?:timestamp|epoch|unix[ _-]?time|ts|time|now)\b)[\"']?\s*[:=]\s*[\"']?"
        r"(?P<value>\d{10}(?:\d{3}){0,3}(?:\.\d+)?)(?!\d|\.\d)",
    ),
)
"""Dates, datetimes, clock times, UUIDs, request ids and labeled epoch timestamps; pass your own tuple to change."""


@dataclass(frozen=True, slots=True)
class DynamicMatch:
    """Locate one per-request value in a text: the pattern that found it and its span."""

    pattern: str
    value: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class MovedValue:
    """Record one value moved out of a static message, at its offset in the original content."""

    pattern: str
    value: str
    message: int
    start: int


@dataclass(frozen=True, slots=True)
class LaidOut:
    """Hold the laid-out messages and the values moved out of their static parts."""

    messages: list[dict[str, Any]]
    moved: tuple[MovedValue, ...]


def find_dynamic(text: str, patterns: Sequence[DynamicPattern] = DEFAULT_PATTERNS) -> list[DynamicMatch]:
    """Return the per-request values in `text`, in order, without overlaps (the longest, then earliest, wins).

    A long text is scanned once and remembered by its digest: a system prompt sent with every request costs its
    scan once (SmolLM2's 4k-token prompt of the benchmarks: 7 ms of the 12 ms a request took to prepare).
    """
    if len(text) < _REMEMBERED_CHARACTERS:
        return _find_dynamic(text, patterns)
    key = (xxhash.xxh3_128_digest(text.encode("utf-8", "surrogatepass")), tuple(patterns))
    with _FOUND_LOCK:
        found = _FOUND.get(key)
        if found is not None:
            _FOUND.move_to_end(key)
            return list(found)
    found = tuple(_find_dynamic(text, patterns))
    if len(found) <= _REMEMBERED_VALUES:
        with _FOUND_LOCK:
            _FOUND[key] = found
            while len(_FOUND) > _REMEMBERED_TEXTS:
                _FOUND.popitem(last=False)
    return list(found)


_REMEMBERED_CHARACTERS = 2048  # shorter texts are scanned every time: in well under a millisecond
_REMEMBERED_TEXTS = 1024  # the most recently used long texts whose values are remembered (only the values are kept)
# A text with more values is scanned every time, so that what is remembered stays small (at most 1,024 x 64 values)
# whatever the prompts: a system prompt holds a few dates and ids, a text of thousands of dates is no shared prefix.
_REMEMBERED_VALUES = 64
_FOUND: OrderedDict[tuple[bytes, tuple[DynamicPattern, ...]], tuple[DynamicMatch, ...]] = OrderedDict()
_FOUND_LOCK = threading.Lock()  # texts are laid out in worker threads, several at once


def _find_dynamic(text: str, patterns: Sequence[DynamicPattern]) -> list[DynamicMatch]:
    candidates: list[tuple[int, int, int, DynamicMatch]] = []
    for rank, pattern in enumerate(patterns):
        for match in pattern.compiled.finditer(text):
            group = "value" if "value" in pattern.compiled.groupindex and match.group("value") else 0
            start, end = match.span(group)
            if end > start:
                candidates.append((start - end, start, rank, DynamicMatch(pattern.name, text[start:end], start, end)))
    # Longest first, so an ISO datetime claims its span before its date and time parts can; a simpler
    # leftmost-first pass would let a short match that starts earlier cut a longer value in two.
    candidates.sort(key=lambda candidate: candidate[:3])
    # One byte per character marks what is taken, so a candidate is checked and claimed in time proportional to its
    # own length. Comparing it with every value kept so far was quadratic in their number (8,000 dates: seconds);
    # a left-to-right sweep is not enough, as candidates come longest first, not in text order. Each pattern's
    # matches do not overlap one another, so all candidates together are at most len(patterns) times the text.
    taken = bytearray(len(text))
    chosen: list[DynamicMatch] = []
    for *_, candidate in candidates:
        if taken.find(1, candidate.start, candidate.end) < 0:
            taken[candidate.start : candidate.end] = b"\x01" * (candidate.end - candidate.start)
            chosen.append(candidate)
    return sorted(chosen, key=lambda kept: kept.start)


def lay_out(messages: Sequence[Mapping[str, Any]], patterns: Sequence[DynamicPattern] = DEFAULT_PATTERNS) -> LaidOut:
    """Move per-request values out of system and developer messages to the end of the last user message."""
    result = [dict(message) for message in messages]
    counts: dict[str, int] = {}
    moved: list[MovedValue] = []
    assignments: list[str] = []
    for index, message in enumerate(result):
        content = message.get("content")
        # Content is a string once canonicalization joined text parts; anything else is left as it came.
        if message.get("role") not in STATIC_ROLES or not isinstance(content, str):
            continue
        pieces: list[str] = []
        position = 0
        for match in find_dynamic(content, patterns):
            # Numbered by order of appearance, never by value: two requests whose dates differ get the same text.
            counts[match.pattern] = counts.get(match.pattern, 0) + 1
            placeholder = f"[{match.pattern} {counts[match.pattern]}]"
            pieces += [content[position : match.start], placeholder]
            position = match.end
            moved.append(MovedValue(match.pattern, match.value, index, match.start))
            assignments.append(f"{placeholder} = {match.value}")
        if pieces:
            message["content"] = "".join(pieces) + content[position:]
    if moved:
        target = _target_index(result)
        result[target] = _append_block(result[target], BLOCK_INTRO + "; ".join(assignments) + ")")
    return LaidOut(result, tuple(moved))


def describe(moved: Sequence[MovedValue], limit: int = 32) -> str:
    """Summarize moved values for a response header: `date@0:27,uuid@0:88` (pattern@message:offset); "" if none."""
    # Names are ASCII identifiers and the rest are integers, so the value is header-safe; past `limit` entries
    # the remainder is only counted (`,+N`), because a prompt full of dates must not grow a kilobyte header.
    entries = [f"{value.pattern}@{value.message}:{value.start}" for value in moved[:limit]]
    if len(moved) > limit:
        entries.append(f"+{len(moved) - limit}")
    return ",".join(entries)


def _target_index(messages: Sequence[Mapping[str, Any]]) -> int:
    # The last user message, not simply the last message: appending to an assistant prefill would put words in the
    # model's mouth, and a tool-loop's later turns then extend the previous request's prompt unchanged.
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            return index
    return len(messages) - 1


def _append_block(message: Mapping[str, Any], block: str) -> dict[str, Any]:
    result = dict(message)
    content = result.get("content")
    if isinstance(content, list):
        result["content"] = [*content, {"type": "text", "text": block}]
    elif isinstance(content, str) and content:
        result["content"] = f"{content}\n\n{block}"
    else:
        result["content"] = block
    return result
