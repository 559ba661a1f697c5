"""A tool-call format: how one family of chat templates has a model write its tool calls, read back and enforced."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefixgate.backends.tool_calls.parser import Body, Markers, ParsedCall, ToolCallParser


def call_id() -> str:
    """Return a new tool call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """Return a new tool call id of nine letters and digits, the form Mistral's chat templates require."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One format: its name, where calls are in an answer and how their bodies read, and the grammar that makes a
    model write calls of given tools in it (for a required or named tool_choice)."""

    name: str
    markers: Markers
    body: Body
    wrap: Callable[[dict[str, Any], bool], str]  # (one call's JSON schema, several allowed) -> the whole grammar
    special_markers: bool = False  # its markers are special tokens: answers are decoded with special tokens kept
    arguments_key: str = "arguments"  # what a call's JSON names its arguments
    new_id: Callable[[], str] = call_id  # an id for a call the model made
    call_at: str = ""  # where `wrap` puts a call's schema in the JSON schema it writes, a JSON pointer ("": its root)

    def parser(self) -> ToolCallParser:
        """Return a parser for one answer."""
        return ToolCallParser(self.markers, self.body)

    def grammar(self, tools: Sequence[dict[str, Any]], *, parallel: bool) -> str:
        """Return a Lark grammar (llguidance's dialect) of answers that call only `tools`, with valid arguments."""
        return self.wrap(call_schema(tools, self.arguments_key, at=self.call_at), parallel)


def call_schema(tools: Sequence[dict[str, Any]], arguments_key: str = "arguments", *, at: str = "") -> dict[str, Any]:
    """Return the JSON schema of one call of any of `tools` (OpenAI function tools): its name and valid arguments.

    `at` is where the schema will sit in the JSON schema document that holds it (a JSON pointer): the tools' own
    references (`"$ref": "#/$defs/..."`, as Pydantic writes them) are made to point at their parameters there.
    """
    options = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = _closed(function.get("parameters") or {"type": "object", "properties": {}})
        option = at if len(tools) == 1 else f"{at}/anyOf/{index}"
        parameters = _rebased(parameters, f"{option}/properties/{arguments_key}")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _rebased(schema: Any, at: str) -> Any:
    """Return the schema with each of its local references (`#`, `#/...`) made to point at it where it sits, `at`, a
    JSON pointer into the schema that holds it."""
    if isinstance(schema, list):
        return [_rebased(item, at) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased(value, at) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str) and (reference == "#" or reference.startswith("#/")):
        rebased["$ref"] = "#" + at + reference[1:]
    return rebased


def _closed(schema: Any) -> Any:
    """Return the schema with each object that lists its properties and says nothing of others closed to them.

    Still valid against the tool's schema, and a forced call then ends: a small model held to an open object keeps
    inventing properties until its tokens run out.
    """
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def json_rule(schema: dict[str, Any]) -> str:
    """Return a grammar expression for compact JSON text valid against `schema`.

    Compact (no white space between tokens): a model held to a grammar that allows white space anywhere may spend
    its whole answer on it, and compact JSON is what the canonical prompt renders a call back as.
    """
    return f"%json {json.dumps(schema | {'x-guidance': {'whitespace_flexible': False}})}"


def call_from(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    """Return the call a decoded JSON object describes (`{"name": ..., "arguments": {...}}`), or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def calls_from(values: Sequence[Any] | None, *keys: str) -> list[ParsedCall] | None:
    """Return the calls decoded JSON values describe, each naming its arguments by the first of `keys` it has
    (`"arguments"` when none are given); None unless there are some and every one reads as a call."""
    names = keys or ("arguments",)
    calls = [
        call_from(value, next((key for key in names if isinstance(value, dict) and key in value), names[0]))
        for value in values or ()
    ]
    return None if not calls or None in calls else [call for call in calls if call is not None]


def json_values(text: str) -> list[Any] | None:
    """Return the JSON values `text` holds one after another (separated by white space or `;`), or None."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
