"""The size of a request's text: refuse a prompt far beyond the context before any rule or the tokenizer reads it.

Canonicalization, layout and tokenizing are linear, but on a 15 MB message they still take seconds that a request
which cannot run should not cost. The backend bounds the characters of a prompt that fits (`max_prompt_chars`); the
text counted here is only what reaches the model's tokenizer in any case, so a prompt that fits is never refused
here. One that passes may still be refused by the rendered text's length, or by its exact token count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefixgate.errors import ContextLengthError

# Roles whose content every chat template renders. Assistant turns are left out: some templates (Qwen3's) drop the
# reasoning of earlier turns, so their text may never reach the tokenizer.
KEPT_ROLES = frozenset({"system", "developer", "user", "tool"})

# Whitespace is not counted: rules strip it at line ends, templates trim it, normalizers may collapse it. What is
# left survives every rule, template and tokenizer unchanged, or composed at most 4 characters into one (NFC,
# NFKC), which the backend's bound allows for.
_WHITESPACE = (" ", "\t", "\n", "\r")


def check_prompt_size(
    messages: Sequence[Mapping[str, Any]] | None, prompt: str | None, context_length: int, max_chars: int | None
) -> None:
    """Raise ContextLengthError when a request holds more text than any prompt of `context_length` tokens can."""
    if max_chars is None:
        return
    count = solid_characters(prompt) if prompt is not None else kept_characters(messages or ())
    if count > max_chars:
        raise ContextLengthError(
            f"this model's maximum context length is {context_length} tokens, and the prompt has {count} characters "
            f"besides whitespace, more than that many tokens can hold (at most {max_chars} characters with this "
            "model's tokenizer); shorten the prompt",
            param="prompt",
        )


def kept_characters(messages: Sequence[Mapping[str, Any]]) -> int:
    """Count the characters other than whitespace in the content every chat template renders."""
    total = 0
    for message in messages:
        if message.get("role") not in KEPT_ROLES:
            continue
        content = message.get("content")
        if isinstance(content, str):
            total += solid_characters(content)
        elif isinstance(content, list):
            texts = (part.get("text") for part in content if isinstance(part, Mapping))
            total += sum(solid_characters(text) for text in texts if isinstance(text, str))
    return total


def solid_characters(text: str) -> int:
    """Count the characters of `text` other than spaces, tabs and line breaks."""
    # str.count is one pass in C per character kind: a 15 MB message is counted in milliseconds.
    return len(text) - sum(map(text.count, _WHITESPACE))
