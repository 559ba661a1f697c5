"""Llama 3.1 to 3.3: a call is the whole answer, a JSON object `{"name": ..., "parameters": {...}}` (after the
`<|python_tag|>` special token, which decoding leaves out); several are separated by `;`."""

from __future__ import annotations

from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, calls_from, json_rule, json_values


def _body(text: str) -> list[ParsedCall] | None:
    return calls_from(json_values(text), "parameters", "arguments")


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    call = json_rule(schema)
    more = ' ("; " one)*' if parallel else ""
    return f"start: one{more}\none: {call}\n"


FORMAT = ToolFormat(
    "llama3_json",
    Markers("{", anywhere=False, start_in_body=True, arguments_keys=("parameters", "arguments")),
    _body,
    _wrap,
    arguments_key="parameters",
)
