"""Tools and structured answers on a local model: the grammar a request's `tool_choice` or `response_format` holds
its answer to, and the answer's tool calls, parsed as it streams by the model's tool-call format."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from prefixgate.backends import TokenChunk
from prefixgate.backends.tool_calls import ToolFormat, json_rule
from prefixgate.errors import RequestError


def answer_grammar(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    response_format: dict[str, Any] | None,
    tool_format: ToolFormat,
) -> str | None:
    """Return the grammar the answer must follow, or None: calls of the tools in the model's format for a `required`
    tool_choice (one call of the function named, for a named one), else JSON for a `json_object` or `json_schema`
    response_format."""
    if tools and tool_choice not in (None, "auto", "none"):
        # A named function is called once; any of them as often as parallel_tool_calls lets (by default, more).
        parallel = tool_choice == "required" and parallel_tool_calls is not False
        return tool_format.grammar(_chosen(tools, tool_choice), parallel=parallel)
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    assert response_format is not None
    schema = {"type": "object"} if kind == "json_object" else (response_format.get("json_schema") or {}).get("schema")
    return f"start: {json_rule(schema if isinstance(schema, dict) else {})}\n"


class ToolCallStream:
    """Turn a local model's answer, chunk by chunk, into text and tool calls, by its format: text that may begin a
    call is held back until it is one or is not (sent as text); a call's arguments stream once it shows it is one."""

    def __init__(self, tool_format: ToolFormat) -> None:
        self._format = tool_format
        self._parser = tool_format.parser()
        self._calls = 0

    def chunk(self, chunk: TokenChunk) -> TokenChunk:
        """Return the chunk with its text split into what is text and the pieces of calls in it."""
        parsed = self._parser.feed(chunk.text)
        text, pieces = parsed.text, parsed.calls
        if chunk.finish_reason is not None:
            rest = self._parser.finish()
            text, pieces = text + rest.text, pieces + rest.calls
        # Each call's first piece names it, and takes an id.
        deltas = tuple(piece if piece.name is None else replace(piece, id=self._format.new_id()) for piece in pieces)
        self._calls += sum(piece.name is not None for piece in pieces)
        # As OpenAI says it: an answer the model ended after calling tools finished to call them.
        finish = "tool_calls" if chunk.finish_reason == "stop" and self._calls else chunk.finish_reason
        return replace(chunk, text=text, tool_calls=deltas, finish_reason=finish)


def _chosen(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> list[dict[str, Any]]:
    if tool_choice == "required":
        return tools
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = tool_choice["function"]["name"]
        named = [tool for tool in tools if tool["function"]["name"] == name]
        if not named:
            listed = ", ".join(repr(tool["function"]["name"]) for tool in tools)
            raise RequestError(
                f"tool_choice names {name!r}, which is not among the tools ({listed})", param="tool_choice"
            )
        return named
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    raise RequestError(
        f"tool_choice {kind!r} is passed on to upstreams that take it; a local model takes none, auto, required or a "
        "named function",
        param="tool_choice",
    )
