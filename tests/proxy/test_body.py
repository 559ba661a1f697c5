"""Request bodies: large ones are decoded and validated off the event loop and in pieces, with the same result and the
same errors as in one piece; `/health` answers while the largest allowed body is being handled."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from prefixgate.errors import RequestError
from prefixgate.proxy import body as body_module
from prefixgate.proxy.body import json_object, parse_json
from prefixgate.proxy.openai.api import ChatCompletionRequest
from tests.proxy.conftest import HANG_GUARD_SECONDS, MODEL, Serve

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def chat(count: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"word {i}"} for i in range(count)], **fields}


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=5), st.integers(0, 3))
def test_a_large_body_decodes_in_pieces_to_what_json_loads_gives(value: dict[str, Any], indent: int) -> None:
    padded = value | {"padding": ["x" * 1000] * 1200}  # past the size decoded in pieces
    text = json.dumps(padded, indent=indent or None)
    assert body_module._decode(text) == json.loads(text)


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, 2,]}', '{"a": 1 "b": 2}', '{"a": [1] x}', "{a: 1}", '{"a": [1, 2'],
)
def test_broken_json_in_pieces_is_refused_as_json_loads_refuses_it(text: str) -> None:
    large = text[:-1] + ', "padding": "' + "x" * (2 << 20) + '"}' if text.endswith("}") else text + " " * (2 << 20)
    with pytest.raises(json.JSONDecodeError):
        json.loads(large)
    with pytest.raises(RequestError, match="not valid JSON"):
        json_object(large.encode())


@pytest.mark.parametrize("padding", [0, 2 << 20])  # decoded in one piece, and in pieces
@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("NaN", "NaN is not a JSON number"),
        ("-Infinity", "-Infinity is not a JSON number"),
        ("[1, Infinity]", "Infinity is not a JSON number"),
        ("9" * 5000, "an integer of 5000 digits; at most 1000"),
        ("-1e400", "the number -1e400 is too large"),
    ],
)
def test_numbers_json_has_not_are_refused_with_what_to_send(value: str, says: str, padding: int) -> None:
    text = '{"padding": "' + "x" * padding + '", "temperature": ' + value + "}"
    with pytest.raises(RequestError, match=f"not valid JSON: {says}"):
        json_object(text.encode())


def test_a_long_list_validated_in_pieces_names_the_item_at_fault_by_its_place_in_the_whole() -> None:
    body = chat(2000)
    assert len(parse_json(json.dumps(body).encode(), ChatCompletionRequest).messages) == 2000
    body["messages"][1500]["role"] = "wizard"
    with pytest.raises(ValidationError) as refused:
        parse_json(json.dumps(body).encode(), ChatCompletionRequest)
    with pytest.raises(ValidationError) as whole:
        ChatCompletionRequest.model_validate(body)
    assert refused.value.errors()[0]["loc"] == whole.value.errors()[0]["loc"] == ("messages", 1500, "role")
    assert refused.value.errors()[0]["msg"] == whole.value.errors()[0]["msg"]


async def test_health_answers_while_the_largest_body_is_handled(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    client = await serve(max_body_bytes="16MiB")
    raw = json.dumps(chat(200_000)).encode()  # 200,000 one-word messages: about 7 MiB
    handling = threading.Event()
    answered = threading.Event()
    check = body_module._check_values

    def held_check(body: dict[str, Any]) -> None:
        # On the loop, this would hold /health until the test gives up: the loop could not answer it.
        handling.set()
        assert answered.wait(HANG_GUARD_SECONDS), "/health was not answered while the body was handled"
        check(body)

    monkeypatch.setattr(body_module, "_check_values", held_check)
    big = asyncio.create_task(
        client.post("/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"})
    )
    assert await asyncio.to_thread(handling.wait, HANG_GUARD_SECONDS)
    health = await client.get("/health")
    answered.set()
    assert health.status == 200
    response = await big
    assert response.status == 400  # far beyond the tiny model's context: refused, after being read whole
    assert "context" in (await response.json())["error"]["message"]
