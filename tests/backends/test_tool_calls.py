"""Tool-call formats: each parser on recorded answers of its family, whole and split across stream pieces at every
point, text that only looks like a call left as text; a call's arguments streamed as they are written, and as far as
they came when the answer ends; any answer parsed the same however it is cut; which format a chat template has; and,
for each format, the tiny model of that family's template held by the format's grammar to a call valid against the
tool's schema."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from prefixgate.backends import HFBackend, SamplingParams, ToolCallDelta
from prefixgate.backends.tool_calls import (
    Parsed,
    ParsedCall,
    ToolFormat,
    format_for,
    generic,
    hermes,
    llama3_json,
    mistral,
)
from prefixgate.proxy.answer import assemble
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.store import BlockLayout, StoreConfig, TierConfig, TieredStore
from tests.backends.tiny_models import make_llama, make_tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A forecast.", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

# Answers as each family's models write them: text before the calls where the format allows it, several calls.
RECORDED: list[tuple[ToolFormat, str, str, list[ParsedCall]]] = [
    (
        hermes.FORMAT,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n\n",
        [ParsedCall("get_weather", '{"city":"Paris","days":2}'), ParsedCall("get_time", "{}")],
    ),
    (
        llama3_json.FORMAT,
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "get_time", "parameters": {}}',
        "",
        [ParsedCall("get_weather", '{"city":"Paris","days":2}'), ParsedCall("get_time", "{}")],
    ),
    (
        mistral.FORMAT,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [ParsedCall("get_weather", '{"city":"Paris","days":2}'), ParsedCall("get_time", "{}")],
    ),
    (
        generic.FORMAT,
        '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]}',
        "",
        [ParsedCall("get_weather", '{"city":"Paris","days":2}')],
    ),
]
# Text that only looks like a call, in each format: it stays text, every character of it.
LOOKALIKES: list[tuple[ToolFormat, str]] = [
    (hermes.FORMAT, "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>, and end with <tool_ca"),
    (hermes.FORMAT, 'Almost: <tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    (hermes.FORMAT, "A number is no call: <tool_call>5</tool_call>"),
    (llama3_json.FORMAT, '{"answer": 42, "note": "a JSON answer, not a call"}'),
    (llama3_json.FORMAT, 'The object {"name": "get_time", "parameters": {}} is an example.'),
    (mistral.FORMAT, "Use [TOOL_CALLS] followed by JSON. [TOOL_CALLS] not json"),
    (generic.FORMAT, '{"tool_calls": "none today"}'),
    (generic.FORMAT, "  {not json at all"),
]


def parse(tool_format: ToolFormat, pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    """Return the text an answer streamed in `pieces` sends, and its calls, each joined from its pieces."""
    parser = tool_format.parser()
    text, calls = [], []
    for piece in pieces:
        parsed = parser.feed(piece)
        text.append(parsed.text)
        calls += parsed.calls
    parsed = parser.finish()
    calls += parsed.calls
    named = [call for call in calls if call.name is not None]
    assert [call.index for call in named] == list(range(len(named)))  # each call named once, by its first piece
    joined = [
        ParsedCall(call.name or "", "".join(c.arguments for c in calls if c.index == call.index)) for call in named
    ]
    return "".join(text) + parsed.text, joined


def splits(text: str) -> Iterator[list[str]]:
    """Yield the text whole, character by character, and cut in two at every point."""
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


@pytest.mark.parametrize(("tool_format", "answer", "text", "calls"), RECORDED, ids=[r[0].name for r in RECORDED])
def test_each_format_reads_its_familys_calls_however_the_stream_cuts_them(
    tool_format: ToolFormat, answer: str, text: str, calls: list[ParsedCall]
) -> None:
    for pieces in splits(answer):
        assert parse(tool_format, pieces) == (text, calls), pieces


@pytest.mark.parametrize(
    ("tool_format", "answer"), LOOKALIKES, ids=[f"{f.name}-{i}" for i, (f, _) in enumerate(LOOKALIKES)]
)
def test_text_that_only_looks_like_a_call_stays_text(tool_format: ToolFormat, answer: str) -> None:
    for pieces in splits(answer):
        assert parse(tool_format, pieces) == (answer, []), pieces


def test_llama3_calls_may_name_their_arguments_either_way() -> None:
    answer = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
    assert parse(llama3_json.FORMAT, [answer]) == ("", [ParsedCall("get_weather", '{"city":"Paris","days":2}')])


@pytest.mark.parametrize(("tool_format", "answer", "text", "calls"), RECORDED, ids=[r[0].name for r in RECORDED])
def test_a_calls_arguments_stream_from_its_name_on_as_the_model_writes_them(
    tool_format: ToolFormat, answer: str, text: str, calls: list[ParsedCall]
) -> None:
    parser = tool_format.parser()
    sent: list[tuple[int, str]] = []  # (characters of the answer fed, a piece's arguments)
    for at, char in enumerate(answer, 1):
        sent += [(at, piece.arguments) for piece in parser.feed(char).calls if piece.arguments]
    sent += [(len(answer), piece.arguments) for piece in parser.finish().calls if piece.arguments]
    # The first call's arguments begin with the character that opens them, and each character goes as it comes.
    opens = answer.index("{", answer.index(calls[0].name) + len(calls[0].name))
    assert sent[0] == (opens + 1, "{")
    streamed = [(at, arguments) for at, arguments in sent if at < len(answer)]
    assert "".join(arguments for _, arguments in streamed) == "".join(call.arguments for call in calls)


@pytest.mark.parametrize(("tool_format", "answer", "text", "calls"), RECORDED, ids=[r[0].name for r in RECORDED])
def test_a_call_cut_off_by_the_answers_end_keeps_the_arguments_it_wrote(
    tool_format: ToolFormat, answer: str, text: str, calls: list[ParsedCall]
) -> None:
    cut = answer.index('"Paris"') + len('"Par')  # as max_tokens cuts an answer
    assert parse(tool_format, [answer[:cut]]) == (text.removesuffix("\n"), [ParsedCall("get_weather", '{"city":"Par')])


def test_a_call_that_names_itself_after_its_arguments_or_writes_them_as_a_string_goes_whole() -> None:
    # Its name is not known when its arguments begin, so nothing of it streams; its body reads whole at its end.
    backwards = '<tool_call>{"arguments": {"city": "Paris", "days": 2}, "name": "get_weather"}</tool_call>'
    as_string = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 2}"}</tool_call>'
    )
    for answer in (backwards, as_string):
        parser = hermes.FORMAT.parser()
        assert parser.feed(answer[: -len("</tool_call>")]) == Parsed("")
        assert parser.feed("</tool_call>") == Parsed(
            "", (ToolCallDelta(0, name="get_weather", arguments='{"city":"Paris","days":2}'),)
        )


def test_white_space_in_the_arguments_strings_is_kept_and_between_their_tokens_left_out() -> None:
    answer = (
        '<tool_call>\n{"name": "note", "arguments": {"text": " two  spaces\\n ", "tags": [ "a" , "b" ]}}\n</tool_call>'
    )
    assert parse(hermes.FORMAT, list(answer)) == (
        "",
        [ParsedCall("note", '{"text":" two  spaces\\n ","tags":["a","b"]}')],
    )


# What the property below edits answers with: each format's markers, JSON's punctuation, the keys calls use.
PIECES = [
    *("<tool_call>", "</tool_call>", "[TOOL_CALLS]", ";", "\n", " ", "a"),
    *("{", "}", "[", "]", ":", ",", '"', "\\", "1", "true"),
    *('"name"', '"arguments"', '"parameters"', '"tool_calls"', '"get_time"', '"x y"', '"\\""'),
]


@st.composite
def edited_answers(draw: st.DrawFn) -> str:
    """Return a recorded answer of any format with a few pieces put in or characters taken out."""
    answer = draw(st.sampled_from([recorded for _, recorded, _, _ in RECORDED]))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(answer)))
        if draw(st.booleans()):
            answer = answer[:at] + draw(st.sampled_from(PIECES)) + answer[at:]
        else:
            answer = answer[:at] + answer[at + draw(st.integers(1, 8)) :]
    return answer


@settings(max_examples=300, deadline=None)
@given(edited_answers(), st.lists(st.integers(0, 200), max_size=8))
def test_any_answer_parses_the_same_however_the_stream_cuts_it(answer: str, cuts: list[int]) -> None:
    at = sorted({min(cut, len(answer)) for cut in cuts} | {0, len(answer)})
    split = [answer[start:end] for start, end in itertools.pairwise(at)]
    for tool_format in (hermes.FORMAT, llama3_json.FORMAT, mistral.FORMAT, generic.FORMAT):
        whole = parse(tool_format, [answer])  # parse also checks that calls are numbered in the order they begin
        assert parse(tool_format, split) == whole
        assert parse(tool_format, list(answer)) == whole


def test_plain_text_is_held_back_only_while_it_may_begin_a_call() -> None:
    parser = hermes.FORMAT.parser()
    assert parser.feed("Hello <tool").text == "Hello "  # "<tool" may begin "<tool_call>"
    assert parser.feed("s are fun").text == "<tools are fun"
    at_start = generic.FORMAT.parser()
    assert at_start.feed("  ").text == ""  # white space before a possible call
    assert at_start.feed("Sure").text == "  Sure"  # not a call: everything goes, and all that follows at once
    assert at_start.feed(' {"tool_calls": []}').text == ' {"tool_calls": []}'


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n"
    "Return each call as JSON within <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for call in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments }}}\n</tool_call>'
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nEnvironment: ipython\nAnswer a call as JSON: "
    '{"name": function name, "parameters": arguments}.\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}'
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}"
    '<|python_tag|>{% for call in m.tool_calls %}{"name": "{{ call.function.name }}", "parameters": '
    "{{ call.function.arguments }}}{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = [
    (HERMES_TEMPLATE, hermes.FORMAT),
    (LLAMA3_TEMPLATE, llama3_json.FORMAT),
    (MISTRAL_TEMPLATE, mistral.FORMAT),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", generic.FORMAT),
]


@pytest.mark.parametrize(("template", "expected"), FAMILIES, ids=[f.name for _, f in FAMILIES])
def test_a_chat_template_says_its_format(template: str, expected: ToolFormat) -> None:
    assert format_for(template) is expected
    assert format_for(None) is generic.FORMAT


def engine_on(template: str, seed: int = 0) -> tuple[Engine, PreTrainedModel]:
    tokenizer = make_tokenizer(template)
    model = make_llama(tokenizer, seed=seed, max_position_embeddings=2048)  # tool definitions take room
    backend = HFBackend(model, tokenizer, model_id="tiny", block_size=8)
    g = backend.geometry
    config = StoreConfig(TierConfig(0), TierConfig(16 << 20), TierConfig(0))
    return Engine(backend, TieredStore.open(None, BlockLayout(g.block_shape, g.dtype), config)), model


async def answer(engine: Engine, **fields: Any) -> tuple[Any, str | None]:
    params = SamplingParams(max_tokens=120, temperature=0.0)
    request = PromptRequest(
        params, messages=[{"role": "user", "content": "Forecast for Paris?"}], tools=TOOLS, **fields
    )
    generation = await engine.generate(request)
    async with generation:
        whole = assemble([chunk async for chunk in generation])
    return whole, generation.finish_reason


@pytest.mark.parametrize(("template", "tool_format"), FAMILIES, ids=[f.name for _, f in FAMILIES])
async def test_a_required_or_named_call_from_a_random_model_is_valid_in_its_familys_format(
    template: str, tool_format: ToolFormat
) -> None:
    engine, _ = engine_on(template)
    try:
        assert engine.backend.tool_format is tool_format
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):  # one call each: parallel calls off, and a named function is called once
            whole, finish = await answer(engine, tool_choice=choice, parallel_tool_calls=False)
            assert finish == "tool_calls" and whole.text == "" and len(whole.tool_calls) == 1, whole
            for call in whole.tool_calls:
                schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
                jsonschema.validate(json.loads(call.arguments), schema)
                assert choice == "required" or call.name == "get_weather"
                assert call.id.startswith("call_") if tool_format is not mistral.FORMAT else len(call.id) == 9
    finally:
        await engine.close()


@pytest.mark.parametrize(("template", "tool_format"), FAMILIES, ids=[f.name for _, f in FAMILIES])
async def test_a_required_call_follows_tools_whose_schemas_refer_to_their_own_definitions(
    template: str, tool_format: ToolFormat
) -> None:
    # As Pydantic writes them: `$defs` beside the properties and `$ref`s to `#/$defs/...`, in each of two tools.
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
                    "required": ["place", "unit"],
                    "$defs": {"Place": {"type": "string", "maxLength": 8}, "Unit": {"enum": ["c", "f"]}},
                },
            },
        }
        for name in ("get_weather", "get_time")
    ]
    engine, _ = engine_on(template)
    try:
        assert engine.backend.tool_format is tool_format
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):  # a random model: one call
            request = PromptRequest(
                SamplingParams(max_tokens=120, temperature=0.0),
                messages=[{"role": "user", "content": "Forecast for Paris?"}],
                tools=tools,
                tool_choice=choice,
                parallel_tool_calls=False,
            )
            generation = await engine.generate(request)
            async with generation:
                whole = assemble([chunk async for chunk in generation])
            assert generation.finish_reason == "tool_calls" and whole.tool_calls, whole
            for call in whole.tool_calls:
                jsonschema.validate(json.loads(call.arguments), tools[0]["function"]["parameters"])
    finally:
        await engine.close()


async def test_a_json_schema_answer_from_a_random_model_is_valid() -> None:
    engine, _ = engine_on(HERMES_TEMPLATE)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,  # as OpenAI's strict schemas have it: a random model then has to stop
    }
    try:
        json_schema = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
        request = PromptRequest(
            # min_tokens past the schema's end: once the JSON is whole, the grammar's end wins.
            SamplingParams(max_tokens=120, temperature=0.0, min_tokens=100),
            messages=[{"role": "user", "content": "A person?"}],
            response_format=json_schema,
        )
        generation = await engine.generate(request)
        async with generation:
            text = assemble([chunk async for chunk in generation]).text
        assert generation.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    finally:
        await engine.close()


def test_the_generic_format_tells_the_tools_and_renders_calls_and_results_as_plain_turns() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Forecast?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    rendered = generic.render(messages, TOOLS)
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n" + generic.INSTRUCTIONS)
    assert json.dumps(TOOLS[0]["function"], sort_keys=True) in rendered[0]["content"]
    assert rendered[2] == {
        "role": "assistant",
        "content": '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris","days":2}}]}',
    }
    assert rendered[3] == {"role": "user", "content": "Result of tool call c1:\nSunny"}
    assert generic.render(messages, TOOLS) == rendered  # the same every time: the next turn extends this prompt
    # Arguments a client sent as text that is no JSON are rendered as that text, not refused with a server error.
    messages[2]["tool_calls"][0]["function"]["arguments"] = "city=Paris"
    assert (
        generic.render(messages, TOOLS)[2]["content"]
        == '{"tool_calls":[{"name":"get_weather","arguments":"city=Paris"}]}'
    )
