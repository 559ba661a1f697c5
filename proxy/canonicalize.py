"""Canonicalization: equivalent requests become identical messages, tools and prompts, hence identical tokens.

Each rule is a pure function on text or JSON, switched by one flag of `CanonicalRules`. A rule is on by default
only where it cannot change what the model is asked: two spellings the reader cannot tell apart become one.
Everything here returns new objects; the request a caller passes in is never modified.
"""

from __future__ import annotations

import copy
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.errors import RequestError

Message = dict[str, Any]
"""An OpenAI chat message as a plain dict, after validation."""


@dataclass(frozen=True, slots=True)
class CanonicalRules:
    """Switch each canonicalization rule on or off."""

    # On: NFC and NFD spellings are canonically equivalent by Unicode's definition and render identically.
    # NFKC was rejected: it folds characters that differ in meaning ("x²" becomes "x2", "ﬁ" becomes "fi").
    unicode_nfc: bool = True
    # On: CRLF, a lone CR and LF all mean "next line" to a reader; which one a client sends depends on its OS.
    newlines: bool = True
    # Off: trailing spaces can carry meaning: a Markdown hard line break, a whitespace-sensitive file the user
    # asks about, or a completion prompt whose final space decides the next token.
    trailing_whitespace: bool = False
    # On: the server renders a list of text parts as the parts joined with "\n" anyway (as vLLM does), so
    # joining here only makes the two spellings of one content the same.
    join_text_parts: bool = True
    # On: JSON objects are unordered (RFC 8259) and whitespace between JSON tokens carries nothing, so a tool
    # schema or a tool call's arguments mean the same in any key order. Numbers keep their exact source text.
    sort_json_keys: bool = True


DEFAULT_RULES = CanonicalRules()
"""The rules on by default: those that cannot change what the model is asked."""

ALL_RULES = CanonicalRules(trailing_whitespace=True)
"""Every rule on, for deployments whose clients never rely on trailing spaces."""


def nfc(text: str) -> str:
    """Return `text` in Unicode normalization form C (composed)."""
    return unicodedata.normalize("NFC", text)


def normalize_newlines(text: str) -> str:
    """Return `text` with CRLF and lone CR line breaks replaced by LF."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def strip_trailing_whitespace(text: str) -> str:
    """Return `text` without spaces and tabs at the end of each line."""
    return _TRAILING.sub("", text)


def join_text_parts(parts: Sequence[Mapping[str, Any]], *, where: str = "content") -> str:
    """Join a list of text content parts with "\\n"; raise `RequestError` for any part that is not text."""
    return "\n".join(_part_text(part, f"{where}[{index}]") for index, part in enumerate(parts))


def sort_json_keys(value: Any) -> Any:
    """Return a copy of a decoded JSON value with every object's keys in sorted order."""
    if isinstance(value, Mapping):
        return {key: sort_json_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list | tuple):
        return [sort_json_keys(item) for item in value]
    return copy.deepcopy(value)


def canonical_json(text: str) -> str:
    """Re-serialize JSON text with sorted keys and compact separators; return text that is not JSON unchanged."""
    try:
        value = json.loads(
            text,
            parse_int=_Number,
            parse_float=_Number,
            parse_constant=_reject_constant,
            object_pairs_hook=_unique_keys,
        )
    except (ValueError, RecursionError):
        # Invalid arguments are what the model produced; passing them through keeps the conversation as it was.
        return text
    return _dump(value)


def canonicalize_text(text: str, rules: CanonicalRules = DEFAULT_RULES) -> str:
    """Apply the text rules (Unicode form, newlines, trailing whitespace) to a string or completion prompt."""
    if rules.unicode_nfc:
        text = nfc(text)
    if rules.newlines:
        text = normalize_newlines(text)
    if rules.trailing_whitespace:
        text = strip_trailing_whitespace(text)
    return text


def canonicalize_messages(
    messages: Sequence[Mapping[str, Any]], rules: CanonicalRules = DEFAULT_RULES
) -> list[Message]:
    """Return new chat messages with the rules applied to their content and tool-call arguments."""
    return [_canonical_message(message, index, rules) for index, message in enumerate(messages)]


def canonicalize_tools(
    tools: Sequence[Mapping[str, Any]] | None, rules: CanonicalRules = DEFAULT_RULES
) -> list[dict[str, Any]] | None:
    """Return new tool definitions with sorted keys and canonical descriptions; pass None through."""
    if tools is None:
        return None
    result: list[dict[str, Any]] = []
    for tool in tools:
        described = _canonical_descriptions(tool, rules)
        result.append(sort_json_keys(described) if rules.sort_json_keys else described)
    return result


# Lookahead rather than consuming the break, so every line ending (LF, CRLF, CR or the end) survives as it was.
# A run is tried only from its first character (the lookbehind) and never given back (possessive): tried from every
# character of a long run of spaces that no line break follows, each try rescanning the rest, it was quadratic.
_TRAILING = re.compile(r"(?<![ \t])[ \t]++(?=\r\n|\r|\n|\Z)")


class _Number(str):
    """A JSON number kept as its source text: re-serializing through float would round or respell it."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A dict would silently keep only the last duplicate; leaving such text alone keeps everything the model saw.
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate key")
    return result


def _dump(value: Any) -> str:
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # keep "é" as the model would read it, not "\u00e9"
    if isinstance(value, dict):
        items = (f"{json.dumps(key, ensure_ascii=False)}:{_dump(value[key])}" for key in sorted(value))
        return "{" + ",".join(items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dump(item) for item in value) + "]"
    return json.dumps(value)  # true, false, null


def _part_text(part: Mapping[str, Any], where: str) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    text = part.get("text") if isinstance(part, Mapping) else None
    if kind != "text" or not isinstance(text, str):
        raise RequestError(
            f"only text content is supported: {where} has type {kind!r}; send text parts or a plain string",
            param="messages",
        )
    return text


def _canonical_message(message: Mapping[str, Any], index: int, rules: CanonicalRules) -> Message:
    result: Message = copy.deepcopy(dict(message))
    content = result.get("content")
    if isinstance(content, str):
        result["content"] = canonicalize_text(content, rules)
    elif isinstance(content, list):
        result["content"] = _canonical_parts(content, f"messages[{index}].content", rules)
    if isinstance(result.get("reasoning_content"), str):
        result["reasoning_content"] = canonicalize_text(result["reasoning_content"], rules)
    tool_calls = result.get("tool_calls")
    if rules.sort_json_keys and isinstance(tool_calls, list):
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function["arguments"] = canonical_json(function["arguments"])
    return result


def _canonical_parts(parts: list[Any], where: str, rules: CanonicalRules) -> str | list[Any]:
    if rules.join_text_parts:
        return canonicalize_text(join_text_parts(parts, where=where), rules)
    # With joining off the list keeps its shape; only the text inside text parts is canonicalized.
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            part["text"] = canonicalize_text(part["text"], rules)
    return parts


def _canonical_descriptions(value: Any, rules: CanonicalRules) -> Any:
    # Only descriptions are prose; names, enums and defaults are identifiers the caller's code matches exactly.
    if isinstance(value, Mapping):
        return {
            key: canonicalize_text(item, rules)
            if key == "description" and isinstance(item, str)
            else _canonical_descriptions(item, rules)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_canonical_descriptions(item, rules) for item in value]
    return copy.deepcopy(value)
