"""Mistral: `[TOOL_CALLS]` (a special token), then a JSON list of `{"name": ..., "arguments": {...}}`."""

from __future__ import annotations

import json
from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, call_from, json_rule, short_call_id


def _body(text: str) -> list[ParsedCall] | None:
    try:
        values = json.loads(text)
    except ValueError:
        return None
    values = values if isinstance(values, list) else [values]
    calls = [call_from(value) for value in values]
    return None if not calls or None in calls else [call for call in calls if call is not None]


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    call = json_rule(schema)
    more = ' (", " one)*' if parallel else ""
    return f'start: "[TOOL_CALLS]" "[" one{more} "]"\none: {call}\n'


FORMAT = ToolFormat("mistral", Markers("[TOOL_CALLS]"), _body, _wrap, special_markers=True, new_id=short_call_id)
