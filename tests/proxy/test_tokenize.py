"""vLLM's /tokenize and /detokenize on the local model, through HTTP: a prompt's tokens are the ones the chat and
completions routes compute (through the template and the layout), they decode back to its text, the completions route
takes them as its prompt, and bad input is a 400 that says what to change."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.proxy.conftest import MODEL, SYSTEM, Serve
from tests.proxy.conftest import chat_body as chat

DATED = SYSTEM + "Today is 2026-12-07."  # the layout moves the date out of the system prompt
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


async def test_a_chats_tokens_are_the_ones_its_completion_computes_and_decode_to_its_text(serve: Serve) -> None:
    client = await serve()
    for body in (chat(system=DATED), chat(system=DATED, layout=False), chat(tools=TOOLS)):
        answered = await (await client.post("/v1/chat/completions", json=body)).json()
        shown = {name: body[name] for name in ("model", "messages", "tools", "layout") if name in body}
        reply = await client.post("/tokenize", json=shown)
        assert reply.status == 200
        tokenized = await reply.json()
        assert tokenized["count"] == len(tokenized["tokens"]) == answered["usage"]["prompt_tokens"]
        assert tokenized["max_model_len"] == 1024
        decoded = await (await client.post("/detokenize", json={"tokens": tokenized["tokens"]})).json()
        assert body["messages"][1]["content"] in decoded["prompt"]
        assert ("2026-12-07" in decoded["prompt"]) == ("2026-12-07" in body["messages"][0]["content"])
    messages = chat(system=DATED)["messages"]
    laid_out = await (await client.post("/tokenize", json={"messages": messages})).json()
    as_sent = await (await client.post("/tokenize", json={"messages": messages, "layout": False})).json()
    assert laid_out["tokens"] != as_sent["tokens"]  # the prompt the engine computes: the date moved, or not


async def test_a_completions_prompt_tokenizes_as_its_route_computes_it_and_decodes_back(serve: Serve) -> None:
    client = await serve()
    prompt = "The capital of France is"
    answered = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    tokenized = await (await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})).json()
    assert tokenized["count"] == (await answered.json())["usage"]["prompt_tokens"]
    decoded = await (await client.post("/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]})).json()
    assert decoded["prompt"].endswith(prompt)


async def test_a_completion_of_token_ids_answers_as_one_of_their_text_and_shares_its_cache(serve: Serve) -> None:
    server = await serve()
    completions = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0).completions
    prompt = SYSTEM + "The capital of France is"
    tokens = (await (await server.post("/tokenize", json={"prompt": prompt})).json())["tokens"]
    fields: Any = {"model": MODEL, "max_tokens": 6, "temperature": 0}
    as_text = await completions.create(prompt=prompt, **fields)
    for sent in (tokens, [tokens]):  # the prompt alone, or in a list of one
        as_ids = await completions.create(prompt=sent, **fields)
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage is not None and as_text.usage is not None
        assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(tokens)
        assert as_ids.usage.prompt_tokens_details is not None
        assert as_ids.usage.prompt_tokens_details.cached_tokens > 0  # the text's blocks: ids are keyed as they are


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "words"),
    [
        ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400, None, "not both"),
        ("/tokenize", {}, 400, None, "either prompt"),
        ("/tokenize", {"prompt": "Hi", "tools": TOOLS}, 400, "tools", "tools go with messages"),
        ("/tokenize", {"prompt": "Hi", "chat_template_kwargs": {}}, 400, "chat_template_kwargs", "go with messages"),
        ("/tokenize", {"prompt": "Hi", "add_special_tokens": False}, 400, "add_special_tokens", "unknown field"),
        ("/tokenize", {"model": "other", "prompt": "Hi"}, 404, "model", "does not exist"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "outside this model's vocabulary"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "ids run from 0"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", "integer"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", "outside this model's vocabulary"),
        ("/v1/completions", {"model": MODEL, "prompt": [[1], [2]]}, 400, "prompt", "one prompt per request"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", "must not be empty"),
    ],
    ids=[
        "both",
        "neither",
        "tools-without-messages",
        "template-variables-without-messages",
        "unknown-field",
        "other-model",
        "too-large",
        "negative",
        "text",
        "a-prompt-id-too-large",
        "two-prompts-of-ids",
        "no-ids",
    ],
)
async def test_bad_tokenize_input_is_an_error_that_says_what_to_change(
    serve: Serve, path: str, body: dict[str, Any], status: int, param: str | None, words: str
) -> None:
    reply = await (await serve()).post(path, json=body)
    assert reply.status == status
    error = (await reply.json())["error"]
    assert words in error["message"] and error["param"] == param
