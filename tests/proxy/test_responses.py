"""OpenAI's Responses API on the local model, through HTTP with the official `openai` client: the answer a chat
completion gives, whole and streamed in the events' order, from the cache on a repeat; incomplete answers; forced tool
calls as function_call items with their arguments streamed; a conversation's items sent back; and the 400s of what a
stateless server does not take."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient

from prefixgate.proxy.answer import Answer, ToolCall
from prefixgate.proxy.openai.responses import ResponsesRequest, output_items
from tests.proxy.conftest import MODEL, SYSTEM, Serve

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "The weather.", "parameters": WEATHER}]


def client_of(server: TestClient[Any, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0)


async def test_a_response_is_the_chat_completions_answer_and_its_repeat_reads_the_cache(serve: Serve) -> None:
    client = client_of(await serve())
    fields: Any = {"model": MODEL, "temperature": 0}
    chat = await client.chat.completions.create(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], max_tokens=12, **fields
    )
    first = await client.responses.create(instructions=SYSTEM, input="Hi", max_output_tokens=12, **fields)
    assert first.output_text == chat.choices[0].message.content
    assert first.usage is not None and chat.usage is not None
    assert first.usage.input_tokens == chat.usage.prompt_tokens
    assert first.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    again = await client.responses.create(instructions=SYSTEM, input="Hi", max_output_tokens=12, **fields)
    assert again.output_text == first.output_text and again.usage is not None
    assert again.usage.input_tokens_details.cached_tokens > 0


async def test_a_streamed_response_sends_its_events_in_order_and_ends_as_the_whole_one(serve: Serve) -> None:
    client = client_of(await serve())
    fields: Any = {"model": MODEL, "instructions": SYSTEM, "input": "Hi", "temperature": 0}
    whole = await client.responses.create(max_output_tokens=200, **fields)
    assert whole.status == "completed"  # the tiny model ends its turn within 200 tokens
    async with client.responses.stream(max_output_tokens=200, **fields) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas > 1 and final.output_text == whole.output_text and final.id == events[0].response.id  # type: ignore[union-attr]

    cut = await client.responses.create(max_output_tokens=3, **fields)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    async with client.responses.stream(max_output_tokens=3, **fields) as stream:
        last = [event async for event in stream][-1]
    assert last.type == "response.incomplete" and last.response.output[0].content[0].text == cut.output_text  # type: ignore[union-attr]


async def test_include_asks_for_the_messages_logprobs_the_chat_api_gives_whole_and_streamed(serve: Serve) -> None:
    client = client_of(await serve())
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        max_tokens=200,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    expected = chat.choices[0].logprobs.content
    fields: Any = {"model": MODEL, "instructions": SYSTEM, "input": "Hi", "temperature": 0, "max_output_tokens": 200}
    fields |= {"include": ["message.output_text.logprobs"], "top_logprobs": 2}

    def same(got: Any) -> None:
        assert [entry.token for entry in got] == [entry.token for entry in expected]
        assert [entry.logprob for entry in got] == pytest.approx([entry.logprob for entry in expected], abs=1e-4)
        assert [[top.token for top in entry.top_logprobs] for entry in got] == [
            [top.token for top in entry.top_logprobs] for entry in expected
        ]

    whole = await client.responses.create(**fields)
    assert whole.top_logprobs == 2 and whole.output[0].type == "message"
    same(whole.output[0].content[0].logprobs)  # type: ignore[union-attr]
    async with client.responses.stream(**fields) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert final.output[0].type == "message"
    same(final.output[0].content[0].logprobs)  # type: ignore[union-attr]
    done = next(event for event in events if event.type == "response.output_text.done")
    same(done.logprobs)  # type: ignore[union-attr]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    sent = [entry for event in deltas for entry in event.logprobs]  # type: ignore[union-attr]
    assert len(deltas) > 1 and [entry.token for entry in sent] == [entry.token for entry in expected][: len(sent)]
    plain = await client.responses.create(**(fields | {"include": None}))
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text  # type: ignore[union-attr]


async def test_a_forced_call_comes_as_a_function_call_item_whole_and_streamed(serve: Serve) -> None:
    client = client_of(await serve())
    fields: Any = {"model": MODEL, "input": "Weather?", "tools": TOOLS, "max_output_tokens": 200, "temperature": 0}
    fields |= {"tool_choice": {"type": "function", "name": "get_weather"}}
    whole = await client.responses.create(**fields)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    async with client.responses.stream(**fields) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == call.arguments  # the arguments stream as they are written
    [streamed] = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments


def test_a_conversations_items_become_the_chat_messages_they_stand_for() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "A tool."}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
                },
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": '{"sky":"clear"}'},
            ],
            "tools": TOOLS,
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": WEATHER}},
            "max_output_tokens": 9,
        }
    )
    chat = body.to_chat()
    assert [message.model_dump(exclude_none=True) for message in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "reasoning_content": "A tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"sky":"clear"}', "tool_call_id": "call_1"},
    ]
    assert chat.max_completion_tokens == 9 and chat.tools and chat.tools[0].function.name == "get_weather"
    assert chat.response_format is not None and chat.response_format.json_schema == {
        "name": "answer",
        "schema": WEATHER,
        "strict": None,
    }


def test_an_answers_items_are_its_reasoning_its_text_and_its_calls_and_an_empty_message_only_for_nothing() -> None:
    call = ToolCall("call_1", "get_weather", '{"city":"Oslo"}')

    def kinds(text: str, reasoning: str, *calls: ToolCall) -> list[str]:
        return [item["type"] for item in output_items(Answer(text, reasoning, "", calls, (), None))]

    assert kinds("Sunny.", "Look.", call) == ["reasoning", "message", "function_call"]
    assert kinds("", "Look.", call) == ["reasoning", "function_call"]
    assert kinds("", "Cut off while thinking") == ["reasoning"]
    assert kinds("", "") == ["message"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
        ({"background": True}, "background", "unknown field"),
        ({"include": ["file_search_call.results"]}, "include.0", "'message.output_text.logprobs'"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.items.0", "'image' found"),
    ],
    ids=["a-stored-response", "a-hosted-tool", "background", "a-hosted-tools-results", "an-unknown-item"],
)
async def test_what_a_stateless_local_server_does_not_take_is_a_400_that_says_so(
    serve: Serve, fields: dict[str, Any], param: str | None, words: str
) -> None:
    client = client_of(await serve())
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(**({"model": MODEL, "input": "Hi"} | fields))
    error: Any = refused.value.body
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
