"""Canonicalization: equivalent requests become identical, different ones stay different, inputs stay untouched."""

from __future__ import annotations

import copy
import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from prefixgate.errors import RequestError
from prefixgate.proxy.canonicalize import (
    ALL_RULES,
    DEFAULT_RULES,
    CanonicalRules,
    canonical_json,
    canonicalize_messages,
    canonicalize_text,
    canonicalize_tools,
    join_text_parts,
    nfc,
    normalize_newlines,
    sort_json_keys,
    strip_trailing_whitespace,
)

Request = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]


def user(content: Any) -> Request:
    """Return a request of one user message and no tools."""
    return [{"role": "user", "content": content}], None


def parts(*texts: str) -> list[dict[str, Any]]:
    """Return text content parts."""
    return [{"type": "text", "text": text} for text in texts]


def tool_call(arguments: str, name: str = "get_weather") -> Request:
    """Return a request whose assistant message calls `name` with `arguments`."""
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]}], None


def weather_tool(
    parameters: dict[str, Any], name: str = "get_weather", description: str = "Get the weather."
) -> Request:
    """Return a request with one tool definition."""
    tool = {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
    return [{"role": "user", "content": "Weather?"}], [tool]


def canonical(request: Request, rules: CanonicalRules = DEFAULT_RULES) -> tuple[Any, Any]:
    """Return the canonical messages and tools of a request."""
    messages, tools = request
    return canonicalize_messages(messages, rules), canonicalize_tools(tools, rules)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_REORDERED = {"required": ["city"], "properties": {"city": {"type": "string"}}, "type": "object"}

SAME: list[tuple[str, Request, Request]] = [
    ("nfd-vs-nfc", user("cafe\u0301"), user("caf\u00e9")),
    ("crlf-vs-lf", user("a\r\nb\r\n"), user("a\nb\n")),
    ("lone-cr-vs-lf", user("a\rb"), user("a\nb")),
    ("parts-vs-string", user(parts("first", "second")), user("first\nsecond")),
    ("one-part-vs-string", user(parts("only")), user("only")),
    ("parts-with-crlf", user(parts("a\r\n", "b")), user("a\n\nb")),
    ("tool-schema-key-order", weather_tool(SCHEMA), weather_tool(SCHEMA_REORDERED)),
    ("tool-description-nfd", weather_tool(SCHEMA, description="e\u0301"), weather_tool(SCHEMA, description="\u00e9")),
    ("arguments-key-order", tool_call('{"city": "Paris", "unit": "c"}'), tool_call('{"unit":"c","city":"Paris"}')),
    ("arguments-whitespace", tool_call('{\n  "city" : "Paris"\n}'), tool_call('{"city":"Paris"}')),
    ("arguments-nested-order", tool_call('{"a": {"y": 1, "x": [2, 3]}}'), tool_call('{"a":{"x":[2,3],"y":1}}')),
    ("arguments-unicode-escape", tool_call('{"city": "Z\\u00fcrich"}'), tool_call('{"city": "Zürich"}')),
]

# Trailing whitespace is off by default (it can matter), so these are equal only with every rule on.
SAME_WITH_ALL_RULES: list[tuple[str, Request, Request]] = [
    ("trailing-spaces", user("a  \nb\t\nc "), user("a\nb\nc")),
    ("trailing-before-crlf", user("a \r\nb"), user("a\nb")),
    *SAME,
]

DIFFERENT: list[tuple[str, Request, Request]] = [
    ("different-words", user("Summarize the report."), user("Summarise the report.")),
    ("leading-indentation", user("def f():\n    return 1"), user("def f():\nreturn 1")),
    ("inner-spaces", user("a  b"), user("a b")),
    ("tab-vs-spaces", user("a\tb"), user("a    b")),
    ("blank-line-count", user("a\n\nb"), user("a\nb")),
    ("trailing-space-by-default", user("The capital of France is "), user("The capital of France is")),
    ("compatibility-form", user("\ufb01le x\u00b2"), user("file x2")),
    ("parts-are-not-concatenated", user(parts("a", "b")), user("ab")),
    ("different-tool-name", weather_tool(SCHEMA), weather_tool(SCHEMA, name="get_forecast")),
    ("different-tool-description", weather_tool(SCHEMA), weather_tool(SCHEMA, description="Get the forecast.")),
    ("different-required", weather_tool(SCHEMA), weather_tool({**SCHEMA, "required": []})),
    ("enum-order", weather_tool({"enum": ["c", "f"]}), weather_tool({"enum": ["f", "c"]})),
    ("different-number", tool_call('{"days": 1}'), tool_call('{"days": 2}')),
    ("int-vs-float-spelling", tool_call('{"days": 1}'), tool_call('{"days": 1.0}')),
    ("array-order", tool_call('{"cities": ["Paris", "Rome"]}'), tool_call('{"cities": ["Rome", "Paris"]}')),
    ("string-inner-space", tool_call('{"city": "New York"}'), tool_call('{"city": "NewYork"}')),
    ("different-called-tool", tool_call('{"city": "Paris"}'), tool_call('{"city": "Paris"}', name="get_time")),
]


@pytest.mark.parametrize(("a", "b"), [row[1:] for row in SAME], ids=[row[0] for row in SAME])
def test_equivalent_requests_become_identical(a: Request, b: Request) -> None:
    assert canonical(a) == canonical(b)


@pytest.mark.parametrize(("a", "b"), [r[1:] for r in SAME_WITH_ALL_RULES], ids=[r[0] for r in SAME_WITH_ALL_RULES])
def test_equivalent_requests_become_identical_with_every_rule_on(a: Request, b: Request) -> None:
    assert canonical(a, ALL_RULES) == canonical(b, ALL_RULES)


@pytest.mark.parametrize(("a", "b"), [row[1:] for row in DIFFERENT], ids=[row[0] for row in DIFFERENT])
def test_requests_that_ask_different_things_stay_different(a: Request, b: Request) -> None:
    assert canonical(a) != canonical(b)


STILL_DIFFERENT = [row for row in DIFFERENT if row[0] != "trailing-space-by-default"]


@pytest.mark.parametrize(("a", "b"), [row[1:] for row in STILL_DIFFERENT], ids=[row[0] for row in STILL_DIFFERENT])
def test_requests_that_ask_different_things_stay_different_with_every_rule_on(a: Request, b: Request) -> None:
    assert canonical(a, ALL_RULES) != canonical(b, ALL_RULES)


# One pair per rule that only that rule makes equal.
RULE_PAIRS: dict[str, tuple[Request, Request]] = {
    "unicode_nfc": (user("e\u0301"), user("\u00e9")),
    "newlines": (user("a\r\nb"), user("a\nb")),
    "trailing_whitespace": (user("a \nb"), user("a\nb")),
    "join_text_parts": (user(parts("a", "b")), user("a\nb")),
    "sort_json_keys": (tool_call('{"b": 1, "a": 2}'), tool_call('{"a":2,"b":1}')),
}


def test_every_rule_has_a_pair() -> None:
    assert set(RULE_PAIRS) == {f.name for f in fields(CanonicalRules)}


@pytest.mark.parametrize("rule", sorted(RULE_PAIRS))
def test_each_rule_can_be_turned_off(rule: str) -> None:
    a, b = RULE_PAIRS[rule]
    assert canonical(a, ALL_RULES) == canonical(b, ALL_RULES)
    assert canonical(a, replace(ALL_RULES, **{rule: False})) != canonical(b, replace(ALL_RULES, **{rule: False}))


def test_defaults_leave_trailing_whitespace_and_turn_on_the_rest() -> None:
    expected = CanonicalRules(
        unicode_nfc=True, newlines=True, trailing_whitespace=False, join_text_parts=True, sort_json_keys=True
    )
    assert expected == DEFAULT_RULES


def test_canonicalization_leaves_its_input_untouched_and_shares_nothing_with_it() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "cafe\u0301 \r\n"},
        {"role": "user", "content": parts("a\r\n", "b")},
        *tool_call('{"b": 1, "a": 2}')[0],
    ]
    tools = weather_tool(SCHEMA_REORDERED, description="x\r\n")[1]
    before = copy.deepcopy((messages, tools))
    out_messages = canonicalize_messages(messages, ALL_RULES)
    out_tools = canonicalize_tools(tools, ALL_RULES)
    assert (messages, tools) == before
    assert out_messages != messages and out_tools != tools
    out_messages[-1]["tool_calls"][0]["function"]["arguments"] = "changed"
    assert out_tools is not None
    out_tools[0]["function"]["parameters"]["properties"]["city"]["type"] = "changed"
    assert (messages, tools) == before


def test_text_parts_are_canonicalized_in_place_when_joining_is_off() -> None:
    rules = replace(DEFAULT_RULES, join_text_parts=False)
    (message,) = canonicalize_messages(user(parts("a\r\n", "cafe\u0301"))[0], rules)
    assert message["content"] == parts("a\n", "caf\u00e9")


def test_a_non_text_part_is_rejected_with_the_messages_param() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [*parts("look"), image]},
    ]
    with pytest.raises(RequestError, match=r"only text content is supported: messages\[1\]\.content\[1\]") as info:
        canonicalize_messages(messages)
    assert info.value.param == "messages"


def test_assistant_content_none_and_extra_fields_pass_through() -> None:
    messages, _ = tool_call('{"city": "Paris"}')
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'})
    out = canonicalize_messages(messages)
    assert out[1]["content"] is None
    assert out[1]["tool_calls"][0]["id"] == "call_1"
    # A tool result is data the model reads, not a tool call: its JSON text is left exactly as sent.
    assert out[2] == messages[2]


@pytest.mark.parametrize(
    "arguments",
    ['{"city": "Par', '{"a": 1, "a": 2}', "NaN", "", "not json"],
    ids=["cut", "dup", "nan", "empty", "text"],
)
def test_arguments_that_are_not_json_are_left_as_they_are(arguments: str) -> None:
    assert canonical_json(arguments) == arguments


def test_canonical_json_keeps_numbers_and_non_ascii_text_verbatim() -> None:
    text = '{ "z": [1.50, 1e400, -0, 12345678901234567890.123456789], "a": "caf\\u00e9", "m": {"t": true, "n": null} }'
    assert (
        canonical_json(text)
        == '{"a":"café","m":{"n":null,"t":true},"z":[1.50,1e400,-0,12345678901234567890.123456789]}'
    )
    assert json.loads(canonical_json(text))["a"] == "café"


def test_tool_identifiers_are_not_unicode_normalized() -> None:
    (tool,) = canonicalize_tools(weather_tool({"enum": ["cafe\u0301"]}, name="cafe\u0301")[1]) or []
    assert tool["function"]["name"] == "cafe\u0301"
    assert tool["function"]["parameters"]["enum"] == ["cafe\u0301"]


def test_canonicalize_tools_passes_none_through() -> None:
    assert canonicalize_tools(None) is None


def test_sort_json_keys_orders_every_level_and_keeps_list_order() -> None:
    value = {"b": [{"y": 1, "x": 2}, 3], "a": None}
    result = sort_json_keys(value)
    assert json.dumps(result) == '{"a": null, "b": [{"x": 2, "y": 1}, 3]}'


def test_text_rules_as_pure_functions() -> None:
    assert nfc("A\u030a") == "\u00c5"
    assert normalize_newlines("a\r\nb\rc\n") == "a\nb\nc\n"
    assert strip_trailing_whitespace("  a \t\n  b  \r\n\tc\t") == "  a\n  b\r\n\tc"
    assert join_text_parts(parts("a", "", "b")) == "a\n\nb"


@pytest.mark.parametrize(
    ("text", "stripped"),
    [
        ("a" + " \t" * 500_000 + "b", "a" + " \t" * 500_000 + "b"),  # inside a line: kept
        ("a" + " \t" * 500_000 + "\r\nb", "a\r\nb"),
        ("a" + " " * 1_000_000, "a"),
        (" " * 1_000_000, ""),
    ],
    ids=["inside a line", "before a break", "at the end", "nothing else"],
)
def test_a_megabyte_of_blanks_is_kept_inside_a_line_and_stripped_at_its_end(text: str, stripped: str) -> None:
    assert strip_trailing_whitespace(text) == stripped


def test_completion_prompts_keep_their_final_space_by_default() -> None:
    assert canonicalize_text("Paris is \r\n", DEFAULT_RULES) == "Paris is \n"
    assert canonicalize_text("Paris is \r\n", ALL_RULES) == "Paris is\n"


def _smollm2_folder() -> Path | None:
    root = Path.home() / ".cache" / "prefixgate" / "models"
    candidates = sorted(root.glob("smollm2*")) if root.is_dir() else []
    return next((folder for folder in candidates if (folder / "tokenizer.json").is_file()), None)


@pytest.mark.smollm2
@pytest.mark.skipif(_smollm2_folder() is None, reason="no converted SmolLM2 folder in ~/.cache/prefixgate/models")
def test_equivalent_requests_render_to_identical_smollm2_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_smollm2_folder()))

    def render(messages: list[dict[str, Any]]) -> list[int]:
        encoded: Any = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        return [int(token) for token in encoded["input_ids"]]

    crlf_nfd = [{"role": "system", "content": "Be brief.\r\n"}, {"role": "user", "content": "Cafe\u0301?"}]
    lf_nfc = [{"role": "system", "content": "Be brief.\n"}, {"role": "user", "content": "Caf\u00e9?"}]
    assert render(crlf_nfd) != render(lf_nfc)
    assert render(canonicalize_messages(crlf_nfd)) == render(canonicalize_messages(lf_nfc))
