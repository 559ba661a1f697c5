"""The Anthropic Messages face, driven by the official `anthropic` client against the real app on the tiny model:
answers streamed and not, Anthropic's event order and usage fields, cache reads, stop sequences, token counting,
breakpoint validation, errors in Anthropic's shape, and API keys sent as `x-api-key`."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestClient
from transformers import PreTrainedTokenizerFast

from tests.proxy.conftest import MODEL, SYSTEM, Serve

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def client_of(server: TestClient[Any, Any], api_key: str = "unused") -> anthropic.AsyncAnthropic:
    # The base URL is the server's root: the client adds /v1/messages.
    return anthropic.AsyncAnthropic(base_url=str(server.make_url("")), api_key=api_key, max_retries=0)


GREEDY = {"extra_body": {"temperature": 0}}  # the client no longer has temperature; the server takes it


async def ask(server: TestClient[Any, Any], api_key: str = "unused", **fields: Any) -> Any:
    fields = {"model": MODEL, "max_tokens": 8, "system": SYSTEM, "messages": QUESTION} | GREEDY | fields
    return await client_of(server, api_key).messages.create(**fields)


async def test_a_message_and_its_repeat_read_the_prompt_from_the_cache(serve: Serve) -> None:
    server = await serve()
    first = await ask(server)
    again = await ask(server)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.content[0].type == "text" and first.content[0].text
    assert again.content[0].text == first.content[0].text  # greedy, and the cache changes nothing
    assert first.stop_reason in ("end_turn", "max_tokens") and first.stop_sequence is None
    counted = await client_of(server).messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens == counted.input_tokens
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    assert again.usage.cache_creation_input_tokens == 0 and again.usage.output_tokens == first.usage.output_tokens


async def test_a_stream_sends_anthropics_events_in_order_with_the_same_answer(serve: Serve) -> None:
    server = await serve()
    whole = await ask(server)
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "system": SYSTEM, "messages": QUESTION, "stream": True}
    response = await server.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    wire = [line.removeprefix("event: ") for line in (await response.text()).splitlines() if line.startswith("event:")]
    deltas = wire.count("content_block_delta")
    assert deltas >= 1 and wire == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]

    stream = await client_of(server).messages.create(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=QUESTION, stream=True, **GREEDY
    )
    events = [event async for event in stream]
    assert events[0].type == "message_start" and events[0].message.content == []
    assert events[0].message.stop_reason is None
    text = "".join(event.delta.text for event in events if event.type == "content_block_delta")
    assert text == whole.content[0].text
    end = next(event for event in events if event.type == "message_delta")
    assert end.delta.stop_reason == whole.stop_reason
    assert end.usage.output_tokens == whole.usage.output_tokens and end.usage.cache_read_input_tokens > 0

    async with client_of(server).messages.stream(
        model=MODEL, max_tokens=8, system=SYSTEM, messages=QUESTION, **GREEDY
    ) as helper:  # the client's own accumulation of the events
        final = await helper.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.usage.cache_read_input_tokens > 0


async def test_a_stop_sequence_ends_the_answer_and_is_named(serve: Serve) -> None:
    server = await serve()
    text = (await ask(server, max_tokens=16)).content[0].text
    stop = text.strip()[2:5]
    assert stop, f"the tiny model's answer is too short to take a stop sequence from: {text!r}"
    stopped = await ask(server, max_tokens=16, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]


async def test_system_blocks_with_breakpoints_are_taken_and_checked_as_anthropic_checks_them(serve: Serve) -> None:
    server = await serve()
    block = {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    short = {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}
    reply = await ask(server, system=[block, short])
    assert reply.content[0].text

    cases = [
        ({"system": [short] * 5}, "at most 4 cache_control breakpoints"),
        ({"system": [short] * 4, "cache_control": {"type": "ephemeral"}}, "at most 4 cache_control breakpoints"),
        ({"system": [short, block]}, 'ttl "1h" must not come after one with ttl "5m"'),
        ({"system": [block | {"cache_control": {"type": "ephemeral", "ttl": "2h"}}]}, "ttl"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "text, tool_use, tool_result, thinking and redacted_thinking content blocks",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "Hm.", "signature": ""}]}]},
            "a user message carries no thinking blocks",
        ),
        ({"messages": [{"role": "user", "content": []}]}, "content is an empty list; send at least one content block"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "must be less than max_tokens"),
        ({"thinking": {"type": "adaptive"}}, "'enabled' or 'disabled'"),
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"tool_choice": {"type": "tool"}}, 'needs "name", the tool to call'),
    ]
    for fields, message in cases:
        with pytest.raises(anthropic.BadRequestError, match=message) as refused:
            await ask(server, **fields)
        assert refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "invalid_request_error"


async def test_errors_come_in_anthropics_shape_and_keys_work_as_x_api_key(serve: Serve) -> None:
    server = await serve(api_keys={"sk-a": "acme", "sk-b": "globex"})
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await ask(server, api_key="sk-wrong")
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        await ask(server, api_key="sk-a", model="another-model")
    assert missing.value.body["error"]["type"] == "not_found_error" and MODEL in missing.value.message

    await ask(server, api_key="sk-a")
    assert (await ask(server, api_key="sk-b")).usage.cache_read_input_tokens == 0  # tenants share no blocks
    assert (await ask(server, api_key="sk-a")).usage.cache_read_input_tokens > 0


async def test_breakpoints_keep_their_prefixes_and_usage_says_what_was_written_and_read(
    serve: Serve, tokenizer: PreTrainedTokenizerFast
) -> None:
    server = await serve(admin_key="sk-admin", prices={MODEL: "1.5,0.25,2,6"})
    hour = {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    minutes = {"type": "text", "text": "Be brief. " * 8, "cache_control": {"type": "ephemeral"}}
    asked = time.time()
    first = await ask(server, system=[hour, minutes])
    counted = await client_of(server).messages.count_tokens(model=MODEL, system=[hour, minutes], messages=QUESTION)
    written = first.usage.cache_creation
    assert first.usage.cache_read_input_tokens == 0
    created = first.usage.cache_creation_input_tokens
    assert created == written.ephemeral_1h_input_tokens + written.ephemeral_5m_input_tokens
    assert first.usage.input_tokens + first.usage.cache_creation_input_tokens == counted.input_tokens
    # The 1h breakpoint ends with the first system block: full 8-token blocks up to there (BPE may merge the last
    # few characters with what follows them differently, so its end is known to within a block).
    through_system = len(tokenizer("<|im_start|>system\n" + SYSTEM)["input_ids"])
    assert abs(written.ephemeral_1h_input_tokens - through_system // 8 * 8) <= 8
    assert written.ephemeral_5m_input_tokens >= 8  # the second system block, in blocks of its own

    again = await ask(server, system=[hour, minutes])
    assert again.usage.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens

    admin = {"Authorization": "Bearer sk-admin"}
    totals = (await (await server.get("/admin/cache", headers=admin)).json())["totals"]
    assert totals["cache_write_tokens"] == created
    computed = first.usage.input_tokens + again.usage.input_tokens
    cached, answers = again.usage.cache_read_input_tokens, first.usage.output_tokens + again.usage.output_tokens
    expected = (computed * 1.5 + cached * 0.25 + created * 2 + answers * 6) / 1e6
    assert totals["cost"] == pytest.approx(expected, abs=1e-6)  # rounded to 6 places
    listing = await server.get("/admin/cache/entries?limit=1000", headers=admin)
    kept = [entry["retained_until"] for entry in (await listing.json())["data"] if entry["tier"] == "host"]
    hours = [until for until in kept if until is not None and until > asked + 3000]
    minutes_kept = [until for until in kept if until is not None and asked + 290 < until <= time.time() + 300]
    assert len(hours) * 8 == written.ephemeral_1h_input_tokens
    assert len(minutes_kept) * 8 == written.ephemeral_5m_input_tokens
    assert kept.count(None) == len(kept) - len(hours) - len(minutes_kept) > 0  # the question's blocks: policy alone


async def test_max_tokens_zero_fills_the_cache_and_answers_nothing(serve: Serve) -> None:
    server = await serve()
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    warmed = await ask(server, system=system, max_tokens=0)
    assert warmed.content == [] and warmed.stop_reason == "max_tokens" and warmed.usage.output_tokens == 0
    assert warmed.usage.cache_read_input_tokens == 0 and warmed.usage.cache_creation_input_tokens > 0
    asked = await ask(server, system=system)
    assert asked.content[0].text
    assert asked.usage.cache_read_input_tokens >= warmed.usage.cache_creation_input_tokens
    assert asked.usage.cache_creation_input_tokens == 0
    with pytest.raises(anthropic.BadRequestError, match="without stream"):
        await ask(server, system=system, max_tokens=0, stream=True)
