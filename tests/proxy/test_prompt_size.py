"""Prompt size: the text every template renders is counted without whitespace, and only text past the bound fails."""

from __future__ import annotations

from typing import Any

import pytest

from prefixgate.errors import ContextLengthError
from prefixgate.proxy.prompt_size import check_prompt_size, kept_characters, solid_characters


def message(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


def test_whitespace_is_not_counted() -> None:
    assert solid_characters(" a\tb\r\nc  \n") == 3
    assert solid_characters(" " * 1_000_000) == 0


def test_every_role_a_template_renders_in_full_is_counted_and_assistant_turns_are_not() -> None:
    messages = [
        message("system", "ab"),
        message("developer", "c d"),
        message("user", [{"type": "text", "text": "ef"}, {"type": "text", "text": "g"}]),
        message("assistant", "reasoning a template may drop" * 1000),
        message("tool", '{"h": 1}'),
        message("assistant", None),
    ]
    assert kept_characters(messages) == 2 + 2 + 3 + 7


def test_text_past_the_bound_is_refused_with_the_limit_and_what_to_change() -> None:
    messages = [message("system", "x" * 60), message("user", "y" * 40 + " " * 1000)]
    check_prompt_size(messages, None, context_length=10, max_chars=100)
    check_prompt_size(messages + [message("user", "z")], None, context_length=10, max_chars=None)
    with pytest.raises(ContextLengthError) as caught:
        check_prompt_size(messages + [message("user", "z")], None, context_length=10, max_chars=100)
    assert str(caught.value) == (
        "this model's maximum context length is 10 tokens, and the prompt has 101 characters besides whitespace, "
        "more than that many tokens can hold (at most 100 characters with this model's tokenizer); shorten the prompt"
    )
    assert caught.value.param == "prompt"


def test_a_completion_prompt_is_counted_the_same_way() -> None:
    check_prompt_size(None, "a " * 100, context_length=10, max_chars=100)
    with pytest.raises(ContextLengthError, match="101 characters"):
        check_prompt_size(None, "a " * 101, context_length=10, max_chars=100)
