"""Properties over arbitrary input: no request body gets a 5xx, and canonicalization is idempotent and total.

The HTTP properties run the real app on the tiny model, over real sockets, in a thread of its own: hypothesis drives
plain functions, and each example is one request to that server.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.proxy.app import SERVE_OPTIONS, create_app
from prefixgate.proxy.canonicalize import (
    canonical_json,
    canonicalize_messages,
    canonicalize_text,
    canonicalize_tools,
)
from prefixgate.proxy.settings import Settings, load_settings
from tests.proxy.conftest import MODEL, tiny_engine

Post = Callable[[str, Any], tuple[int, str]]
EXAMPLES = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

plain_text = st.text(max_size=60)
# A lone surrogate ("\\ud800") is valid JSON but no text: one string in ten carries one, in every text field.
odd_text = st.text(alphabet=st.one_of(st.characters(), st.characters(categories=["Cs"])), min_size=1, max_size=60)
text = st.one_of(*[plain_text] * 9, odd_text)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=10,
)


def field(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Return a value for a field inside a request field: mostly one the API accepts, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


def bodies(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Return request bodies: half of them well formed, the rest with one field (or an extra one) of any JSON."""
    valid = st.fixed_dictionaries(required, optional=optional)
    names = sorted(required) + sorted(optional) + ["unknown_field"]

    def corrupt(body: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
        return body | {name: value}

    return st.one_of(valid, st.builds(corrupt, valid, st.sampled_from(names), json_values))


parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), min_size=1, max_size=3)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": st.one_of(text, parts)},
    optional={"name": st.text(min_size=1, max_size=10)},
)
odd_message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={
        "content": field(st.one_of(text, parts)),
        "name": field(text),
        "tool_call_id": field(text),
        "tool_calls": field(st.lists(st.fixed_dictionaries({"id": text, "type": st.just("function")}))),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.text(min_size=1, max_size=20)},
            optional={"description": text, "parameters": st.dictionaries(st.text(max_size=8), json_values)},
        ),
    }
)
odd_tool = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(json_values)})
generation_fields = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50),
    "n": st.just(1),
    "stop": st.one_of(text, st.lists(text, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**31),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(
        st.one_of(st.text(max_size=6), st.integers(0, 60_000).map(str)), st.floats(-100, 100), max_size=3
    ),
    "min_tokens": st.integers(0, 8),
    "ignore_eos": st.booleans(),
    "repetition_penalty": st.floats(0.5, 2),
    "user": text,
    "cache_salt": st.text(min_size=1, max_size=256),
    "layout": st.booleans(),
}
chat_bodies = bodies(
    {"model": st.just(MODEL), "messages": st.lists(st.one_of(message, message, odd_message), min_size=1, max_size=3)},
    {
        **generation_fields,
        "max_completion_tokens": st.integers(1, 6),
        "tools": st.lists(st.one_of(tool, tool, odd_tool), max_size=2),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": text})}),
        ),
        "parallel_tool_calls": st.booleans(),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 20),
        "response_format": st.one_of(
            st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
            st.fixed_dictionaries(
                {
                    "type": st.just("json_schema"),
                    "json_schema": st.fixed_dictionaries({"name": text}, optional={"schema": json_values}),
                }
            ),
        ),
        "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    },
)
prompt = st.one_of(st.text(min_size=1, max_size=60), odd_text)
completion_bodies = bodies(
    {"model": st.just(MODEL), "prompt": st.one_of(prompt, st.lists(prompt, min_size=1, max_size=1))},
    {
        **generation_fields,
        "echo": st.booleans(),
        "suffix": st.none(),
        "best_of": st.just(1),
        "logprobs": st.integers(0, 5),
    },
)


text_block = st.fixed_dictionaries({"type": st.just("text"), "text": text})
tool_use = st.fixed_dictionaries(
    {"type": st.just("tool_use"), "id": text, "name": text, "input": st.dictionaries(text, json_values, max_size=3)}
)
tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": text},
    optional={"content": st.one_of(text, st.lists(text_block, max_size=2)), "is_error": st.booleans()},
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.one_of(text, st.lists(st.one_of(text_block, tool_use, tool_result), min_size=1, max_size=3)),
    }
)
anthropic_tool = st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=20), "input_schema": st.dictionaries(st.text(max_size=8), json_values)},
    optional={"description": text},
)
messages_bodies = bodies(
    {
        "model": st.just(MODEL),
        "max_tokens": st.integers(1, 6),
        "messages": st.lists(field(anthropic_message), min_size=1, max_size=3),
    },
    {
        "system": st.one_of(text, st.lists(text_block, max_size=2)),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(st.text(min_size=1, max_size=10), max_size=3),
        "stream": st.booleans(),
        "metadata": st.fixed_dictionaries({}, optional={"user_id": text}),
        "tools": st.lists(anthropic_tool, max_size=2),
        "tool_choice": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
            st.fixed_dictionaries({"type": st.just("tool"), "name": text}),
        ),
        "cache_salt": st.text(min_size=1, max_size=256),
    },
)


@pytest.fixture(scope="module")
def post(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel
) -> Iterator[Post]:
    """Serve the real app on a free port from a thread of its own; yield a function that sends one request."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="served-app", daemon=True)
    thread.start()
    settings = load_settings(store=tmp_path_factory.mktemp("store"), model=MODEL)

    async def factory(settings: Settings) -> Any:
        return tiny_engine(settings, tokenizer, llama, [])

    async def start() -> tuple[web.AppRunner, aiohttp.ClientSession, str]:
        runner = web.AppRunner(create_app(settings, factory), **SERVE_OPTIONS)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        return runner, aiohttp.ClientSession(), f"http://127.0.0.1:{port}"

    runner, session, url = asyncio.run_coroutine_threadsafe(start(), loop).result(60)

    async def send(path: str, body: Any) -> tuple[int, str]:
        data = body if isinstance(body, bytes) else json.dumps(body)
        headers = {"Content-Type": "application/json"}
        async with session.post(url + path, data=data, headers=headers) as response:
            return response.status, await response.text()

    def call(path: str, body: Any) -> tuple[int, str]:
        return asyncio.run_coroutine_threadsafe(send(path, body), loop).result(120)

    yield call
    asyncio.run_coroutine_threadsafe(session.close(), loop).result(60)
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(60)


def assert_answered_as_a_client_error_or_ok(status: int, body: str) -> None:
    event(f"HTTP {status}")  # `pytest --hypothesis-show-statistics` shows how many examples reached the model
    assert status < 500, body
    if status >= 400:
        error = json.loads(body)["error"]
        assert error["type"] in {"invalid_request_error", "rate_limit_error"} and error["message"], body
    # A stream answers 200 before it runs: a fault after that would be an error event in the stream.
    assert "server_error" not in body, body


@EXAMPLES
@given(body=chat_bodies)
def test_no_chat_completions_body_gets_a_server_error(post: Post, body: dict[str, Any]) -> None:
    assert_answered_as_a_client_error_or_ok(*post("/v1/chat/completions", body))


@EXAMPLES
@given(body=completion_bodies)
def test_no_completions_body_gets_a_server_error(post: Post, body: dict[str, Any]) -> None:
    assert_answered_as_a_client_error_or_ok(*post("/v1/completions", body))


@EXAMPLES
@given(body=messages_bodies)
def test_no_messages_body_gets_a_server_error(post: Post, body: dict[str, Any]) -> None:
    status, answer = post("/v1/messages", body)
    event(f"HTTP {status}")
    assert status < 500, answer
    if status >= 400:
        error = json.loads(answer)
        # not_found_error: a model this server does not serve (a corrupted "model" field), as Anthropic answers it.
        kinds = {"invalid_request_error", "rate_limit_error", "not_found_error"}
        assert error["type"] == "error" and error["error"]["type"] in kinds, answer
        assert (error["error"]["type"] == "not_found_error") == (status == 404), answer
    assert "api_error" not in answer, answer  # a stream answers 200 first: a fault would be an error event in it


@EXAMPLES
@given(
    body=st.one_of(json_values, st.binary(max_size=64)),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
def test_no_body_of_any_shape_gets_a_server_error(post: Post, body: Any, path: str) -> None:
    assert_answered_as_a_client_error_or_ok(*post(path, body))


def test_the_server_serves_normally_after_arbitrary_bodies(post: Post) -> None:
    # Runs after the properties above in this module: the same server, after hundreds of odd requests.
    status, body = post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] in {"stop", "length"}


@given(st.text())
def test_canonical_text_is_idempotent_for_any_string(value: str) -> None:
    once = canonicalize_text(value)
    assert canonicalize_text(once) == once


@given(st.text())
def test_canonical_json_is_idempotent_for_any_string(value: str) -> None:
    once = canonical_json(value)
    assert canonical_json(once) == once


@given(st.lists(message, min_size=1, max_size=3), st.one_of(st.none(), st.lists(tool, max_size=2)))
def test_canonical_messages_and_tools_are_idempotent(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    once = canonicalize_messages(messages), canonicalize_tools(tools)
    assert (canonicalize_messages(once[0]), canonicalize_tools(once[1])) == once
