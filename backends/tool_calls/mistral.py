"""Mistral: `[TOOL_CALLS]` (a special token), then a JSON list of `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

import json
from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, calls_from, json_rule, short_call_id


def _body(text: str) -> list[ParsedCall] | None:
    try:
        values = json.loads(text)
    except ValueError:
        return None
    return calls_from(values if isinstance(values, list) else [values])


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    call = json_rule(schema)
    more = ' (", " one)*' if parallel else ""
    return f'start: "[TOOL_CALLS]" "[" one{more} "]"\none: {call}\n'


FORMAT = ToolFormat(
    "mistral", Markers("[TOOL_CALLS]", sites=((), ("[]",))), _body, _wrap, special_markers=True, new_id=short_call_id
)
