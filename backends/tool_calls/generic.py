"""The generic format, for chat templates that render no tools (SmolLM2's among them): the tools and how to call
them are told in the system prompt, and a call is the whole answer, a JSON object
`{"tool_calls": [{"name": ..., "arguments": {...}}]}`. Earlier calls and their results are rendered back as that JSON
and as user turns, the same way every time, so a conversation's next turn extends the previous prompt."""

from __future__ import annotations

import json
from typing import Any

from prefixgate.backends.tool_calls.parser import Markers, ParsedCall
from prefixgate.backends.tool_calls.tool_format import ToolFormat, calls_from, json_rule, json_values

INSTRUCTIONS = (
    "You can call the tools below. To call tools, answer with a JSON object and nothing else, of the form "
    '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments, as the tool\'s parameters say>}}]}. '
    "To answer without calling a tool, answer in plain text.\n\nTools:\n"
)


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Return the messages with the tools told in the system prompt, each tool call written as this format's JSON
    and each tool result as a user turn: plain messages any chat template renders."""
    rendered = [_plain(message) for message in messages]
    if tools:
        listing = "\n".join(json.dumps(tool["function"], ensure_ascii=False, sort_keys=True) for tool in tools)
        told = INSTRUCTIONS + listing
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = rendered[0] | {"content": f"{rendered[0]['content']}\n\n{told}"}
        else:
            rendered.insert(0, {"role": "system", "content": told})
    return rendered


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    content = _text(message.get("content"))
    if message["role"] == "tool":
        call = message.get("tool_call_id", "")
        return {"role": "user", "content": f"Result of tool call {call}:\n{content}"}
    if message.get("tool_calls"):
        calls = [{"name": call["function"]["name"], "arguments": _arguments(call)} for call in message["tool_calls"]]
        # Compact, as the grammar of a forced call has the model write it: the next turn's prompt then repeats the
        # answer's text, and its tokens come from the cache.
        written = json.dumps({"tool_calls": calls}, ensure_ascii=False, separators=(",", ":"))
        return {"role": message["role"], "content": f"{content}\n{written}" if content else written}
    return {"role": message["role"], "content": content}


def _arguments(call: dict[str, Any]) -> Any:
    """Return a call's arguments decoded, or as the text they are when a client sent text that is no JSON."""
    text = call["function"]["arguments"] or "{}"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text", "") for part in content)


def _body(text: str) -> list[ParsedCall] | None:
    values = json_values(text)
    if not values or len(values) != 1 or not isinstance(values[0], dict) or set(values[0]) != {"tool_calls"}:
        return None
    listed = values[0]["tool_calls"]
    return calls_from(listed if isinstance(listed, list) else None)


def _wrap(schema: dict[str, Any], parallel: bool) -> str:
    listed = {"type": "array", "items": schema, "minItems": 1} | ({} if parallel else {"maxItems": 1})
    whole = {"type": "object", "properties": {"tool_calls": listed}, "required": ["tool_calls"]}
    return f"start: {json_rule(whole | {'additionalProperties': False})}\n"


FORMAT = ToolFormat(
    "generic",
    Markers("{", anywhere=False, start_in_body=True, sites=(("tool_calls", "[]"),)),
    _body,
    _wrap,
    call_at="/properties/tool_calls/items",
)
