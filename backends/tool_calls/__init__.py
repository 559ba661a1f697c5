"""Tool calls of local models: a catalogue of formats, one module each, as chat templates have models write calls.

Exports:
- `ToolFormat`, `format_for(chat_template)`: a format (how calls are found in an answer, read, and enforced by a
  grammar), and the one a chat template uses: Hermes and Qwen's `<tool_call>` (`hermes`), Llama 3's JSON
  (`llama3_json`), Mistral's `[TOOL_CALLS]` (`mistral`), else the generic format, whose tools are told in the system
  prompt (`generic`; `generic.render` writes the messages for it).
- `ToolCallParser`, `Parsed`, `ParsedCall`: one answer parsed as it streams.
- `json_rule(schema)`: a grammar expression for compact JSON valid against a schema; `call_id()`: a new call's id.
"""

from prefixgate.backends.tool_calls import generic, hermes, llama3_json, mistral
from prefixgate.backends.tool_calls.parser import Parsed, ParsedCall, ToolCallParser
from prefixgate.backends.tool_calls.tool_format import ToolFormat, call_id, json_rule

# What in a chat template says which format its model writes calls in; the first that matches is taken.
_SIGNS = (
    (hermes.FORMAT, ("<tool_call>",)),
    (mistral.FORMAT, ("[TOOL_CALLS]",)),
    (llama3_json.FORMAT, ("<|python_tag|>", "ipython")),
)


def format_for(chat_template: str | None) -> ToolFormat:
    """Return the format of the tool calls a model with this chat template writes: generic if it renders no tools."""
    template = chat_template or ""
    if "tools" in template:
        for found, signs in _SIGNS:
            if any(sign in template for sign in signs):
                return found
    return generic.FORMAT


__all__ = ["Parsed", "ParsedCall", "ToolCallParser", "ToolFormat", "call_id", "format_for", "generic", "json_rule"]
