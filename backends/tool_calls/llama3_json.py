"""Llama 3.1 to 3.3: a call is the whole answer, a JSON object `{"name": ..., "parameters": {...}}` (after the
`<|python_tag|>` special token, which decoding leaves out); several are separated by `;`."""

from __future__ import annotations

from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, call_from, json_rule, json_values


def _body(text: str) -> list[ParsedCall] | None:
    values = json_values(text)
    calls = [call_from(value, "parameters") or call_from(value) for value in values or ()]
    return None if not calls or None in calls else [call for call in calls if call is not None]


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    call = json_rule(schema)
    more = ' ("; " one)*' if parallel else ""
    return f"start: one{more}\none: {call}\n"


FORMAT = ToolFormat(
    "llama3_json", Markers("{", anywhere=False, start_in_body=True), _body, _wrap, arguments_key="parameters"
)
