"""Hermes and Qwen (2.5, 3): each call a JSON object between `<tool_call>` and `</tool_call>`, after any text."""

from __future__ import annotations

from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, calls_from, json_rule, json_values


def _body(text: str) -> list[ParsedCall] | None:
    return calls_from(json_values(text))


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    call = json_rule(schema)
    more = ' ("\\n" one)*' if parallel else ""
    return f'start: one{more}\none: "<tool_call>\\n" {call} "\\n</tool_call>"\n'


FORMAT = ToolFormat("hermes", Markers("<tool_call>", "</tool_call>"), _body, _wrap)
