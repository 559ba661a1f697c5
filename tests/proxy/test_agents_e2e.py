"""Agents end to end: `prefixgate serve` on the real SmolLM2 (whose chat template renders no tools: the generic
format), driven by the official `openai` and `anthropic` clients. Forced and named tool calls valid against their
schemas, whole and streamed (their arguments in pieces), and cut off by max_tokens; JSON answers valid against theirs;
logprobs that agree with the greedy choices; a tool-result turn served from the cache, through the Chat Completions and
the Responses API; the agent loop example."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from tests.services import Server

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-135m"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
]
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Lisbon?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = Server(tmp_path_factory.mktemp("store"))
    yield started
    started.stop()


def schema_of(name: str) -> dict[str, Any]:
    return next(tool["function"]["parameters"] for tool in TOOLS if tool["function"]["name"] == name)


def test_forced_and_named_tool_calls_are_valid_against_their_schemas_whole_and_streamed(server: Server) -> None:
    client = server.client()
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=64,
            temperature=0,  # type: ignore[arg-type]
        )
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert answer.message.tool_calls
        for call in answer.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
            assert choice == "required" or call.function.name == "get_time"

        stream = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=64,
            temperature=0,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = [chunk for chunk in stream]
        pieces = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
        assert pieces and pieces[0].function is not None
        assert pieces[0].function.name == answer.message.tool_calls[0].function.name  # type: ignore[union-attr]
        streamed = "".join(piece.function.arguments or "" for piece in pieces if piece.function and piece.index == 0)
        assert json.loads(streamed) == json.loads(answer.message.tool_calls[0].function.arguments)  # type: ignore[union-attr]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # The arguments stream as the model writes them: the call's first piece names it, the others add to them.
        first, *rest = [piece for piece in pieces if piece.index == 0]
        assert first.id and first.type == "function" and rest
        assert all(piece.id is None and piece.function and piece.function.name is None for piece in rest)


def test_a_call_cut_off_by_max_tokens_comes_back_as_the_call_it_began(server: Server) -> None:
    client = server.client()
    fields: Any = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    whole = client.chat.completions.create(max_tokens=64, **fields)
    assert whole.choices[0].message.tool_calls and whole.usage
    call = whole.choices[0].message.tool_calls[0].function  # type: ignore[union-attr]
    # Cut inside its arguments (the last tokens close them, the call, the list and the answer's object).
    cut = client.chat.completions.create(max_tokens=whole.usage.completion_tokens - 4, **fields).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and cut.message.tool_calls
    begun = cut.message.tool_calls[0].function  # type: ignore[union-attr]
    assert begun.name == call.name and call.arguments.startswith(begun.arguments) and begun.arguments != call.arguments


def test_json_answers_are_valid_against_their_schema(server: Server) -> None:
    client = server.client()
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    ask: list[Any] = [{"role": "user", "content": "Describe a person as JSON with their name and age."}]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
    sampled = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=200, temperature=0.7, seed=3, response_format={"type": "json_object"}
    )
    if sampled.choices[0].finish_reason == "stop":  # a sampled object may run past max_tokens; what ended is whole
        assert isinstance(json.loads(sampled.choices[0].message.content or ""), dict)


def test_logprobs_agree_with_the_greedy_choices_and_spell_the_answer(server: Server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three primary colors."}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
    assert content and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.logprob <= 0.0
    spelled = "".join(entry.token for entry in content)
    assert spelled.startswith(reply.choices[0].message.content or "")  # the end of turn's token may follow


def test_a_tool_result_turn_starts_from_the_previous_turn_in_the_cache(server: Server) -> None:
    client = server.client()
    system = {"role": "system", "content": "You are a travel assistant. " + "Check the weather before any trip. " * 40}
    messages: list[Any] = [system, *QUESTION]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=32, temperature=0)
    assert first.usage is not None and second.usage is not None and second.usage.prompt_tokens_details is not None
    # The first turn's prompt and the call it wrote, rendered back as the model wrote it, come from the cache.
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        >= first.usage.prompt_tokens + first.usage.completion_tokens - 2
    )


def test_anthropic_clients_get_a_tool_use_block_whole_and_streamed(server: Server) -> None:
    messages = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages
    tools: Any = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_PARAMETERS}]
    fields: Any = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": QUESTION,
        "tools": tools,
        "extra_body": {"temperature": 0},
    }
    whole = messages.create(tool_choice={"type": "tool", "name": "get_weather"}, **fields)
    assert whole.stop_reason == "tool_use"
    uses = [block for block in whole.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_PARAMETERS)
    with messages.stream(tool_choice={"type": "any"}, **fields) as stream:
        events = [event for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert len([delta for delta in deltas if delta.type == "input_json_delta"]) > 1  # the input streams in pieces
    assert [block.input for block in final.content if block.type == "tool_use"] == [uses[0].input]


def test_a_responses_api_tool_loop_sends_its_items_back_and_reads_its_turns_from_the_cache(server: Server) -> None:
    client = server.client()
    tools: Any = [{"type": "function", **tool["function"]} for tool in TOOLS]
    fields: Any = {"model": MODEL, "tools": tools, "max_output_tokens": 64, "temperature": 0}
    first = client.responses.create(input=QUESTION, tool_choice="required", parallel_tool_calls=False, **fields)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), schema_of(call.name))
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    items = [*QUESTION, *(item.model_dump(exclude_none=True) for item in first.output), result]
    second = client.responses.create(input=items, **fields)
    assert first.usage is not None and second.usage is not None
    # The whole first turn, the model's call included, is the second's cached prefix (but the template's last tokens).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 8, (cached, first.usage)


def test_the_agent_loop_example_calls_the_tool_and_serves_the_next_turn_from_the_cache(server: Server) -> None:
    example = Path(__file__).parents[2] / "examples" / "agent_loop.py"
    result = subprocess.run(
        [sys.executable, str(example), "--base-url", f"{server.url}/v1"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("  call: get_weather(") for line in lines), result.stdout
    turns = [line for line in lines if line.startswith("turn ")]
    assert len(turns) == 2 and int(turns[1].split(", ")[1].split()[0]) > int(turns[0].split()[2]), result.stdout
