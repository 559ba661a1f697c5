"""The OpenAI routes `/v1/chat/completions` and `/v1/completions`: a body parsed, its choices generated on the engine,
answered whole or streamed as OpenAI's chunks."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from aiohttp import web

from prefixgate.backends import TokenChunk, TokenLogprob
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import assemble
from prefixgate.proxy.body import parsed
from prefixgate.proxy.choices import Choices
from prefixgate.proxy.openai import api
from prefixgate.proxy.serving import (
    answer_headers,
    engine_for,
    open_stream,
    prompt_request,
    send_data,
    send_event,
    start,
    streaming_failure,
)
from prefixgate.proxy.upstream_engine import UpstreamEngine

log = logging.getLogger(__name__)
_MANY_LOGPROBS = 256  # a chunk with more log probabilities (an echoed prompt's) is made and written out off the loop


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    return await _generate(request, await parsed(await request.read(), api.ChatCompletionRequest), chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    return await _generate(request, await parsed(await request.read(), api.CompletionRequest), chat=False)


async def _generate(
    request: web.Request, body: api.ChatCompletionRequest | api.CompletionRequest, *, chat: bool
) -> web.StreamResponse:
    param = "messages" if chat else "prompt"
    echo = await _echo(request, body) if isinstance(body, api.CompletionRequest) else None
    top = body.logprobs if isinstance(body, api.CompletionRequest) else None  # an echoed prompt's alternatives
    choices = await start(request, body.model, await prompt_request(request, body), prompt_param=param, n=body.n)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # From the response's first byte on: a client that leaves as it is prepared still stops the generation.
        async with choices:
            return await _stream(request, choices, body.model, include_usage, chat=chat, echo=echo, top=top)
    chunks: list[list[TokenChunk]] = [[] for _ in choices.generations]
    async with choices:
        async for index, chunk in _chunks(choices, echo, top):
            chunks[index].append(chunk)
    first = choices.first
    rendering = functools.partial(_rendered, body, chunks, choices, chat=chat)
    # An answer with its prompt's log probabilities holds up to 21 entries a prompt token (an 8k prompt's took 0.23 s
    # to render): it is rendered off the loop.
    scored = body.prompt_logprobs is not None or (echo is not None and top is not None)
    text = await asyncio.to_thread(rendering) if scored else rendering()
    return web.Response(text=text, content_type="application/json", headers=answer_headers(first))


def _rendered(
    body: api.ChatCompletionRequest | api.CompletionRequest,
    chunks: list[list[TokenChunk]],
    choices: Choices,
    *,
    chat: bool,
) -> str:
    """Return a whole answer's JSON: each choice's chunks, and vLLM's `prompt_logprobs` where asked for (the chat
    answer's beside its choices, each text choice's in it)."""
    render = api.chat_completion if chat else api.text_completion
    answers = [(assemble(each), g.finish_reason or "stop") for each, g in zip(chunks, choices.generations, strict=True)]
    first = choices.first
    payload = render(first.request_id, body.model, answers, choices.usage(), first.system_fingerprint)
    if body.prompt_logprobs is not None:
        scored = [api.prompt_logprobs(each[0].prompt_logprobs, body.prompt_logprobs) for each in chunks]
        if chat:
            payload["prompt_logprobs"] = scored[0]
        for choice, each in zip(payload["choices"], scored, strict=True):
            choice["prompt_logprobs"] = None if chat else each
    return json.dumps(payload)


async def _echo(request: web.Request, body: api.CompletionRequest) -> str | None:
    """Return the prompt a completion echoes before its answer, as sent (token ids as the model's tokenizer decodes
    them); None without echo."""
    if not body.echo:
        return None
    prompt = body.sent_prompt()
    if isinstance(prompt, str):
        return prompt
    engine = engine_for(request, body.model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError(
            "echo of a prompt of token ids needs the model's tokenizer, which this server (in front of upstreams) "
            "does not hold; send the prompt as text, or leave out echo",
            param="echo",
        )
    return await asyncio.to_thread(engine.backend.decode, prompt, skip_special_tokens=False)


async def _chunks(choices: Choices, echo: str | None, top: int | None) -> AsyncIterator[tuple[int, TokenChunk]]:
    """Each choice's chunks, by its index; with `echo`, each choice's first carries the prompt before its text, and
    with the answer's log probabilities (`top` alternatives) the prompt's tokens' before its own."""
    echoed: set[int] = set()
    async for index, chunk in choices.chunks():
        if echo is not None and index not in echoed:
            echoed.add(index)
            scored: tuple[TokenLogprob, ...] = ()
            if top is not None:
                scored = chunk.prompt_logprobs
                if len(scored) > 1 and len(scored[1].top) > top:  # vLLM's prompt_logprobs asked for more alternatives
                    scored = tuple(replace(entry, top=entry.top[:top]) for entry in scored)
            chunk = replace(chunk, text=echo + chunk.text, logprobs=scored + chunk.logprobs)
        yield index, chunk


async def _stream(
    request: web.Request,
    choices: Choices,
    model: str,
    include_usage: bool,
    *,
    chat: bool,
    echo: str | None = None,
    top: int | None = None,
) -> web.StreamResponse:
    """Send the choices as server-sent events, exactly as OpenAI does, each chunk one choice's (by its index) as it
    comes (an echoed prompt first, its `top` alternatives as in `_chunks`); the caller closes the choices."""
    response = await open_stream(request, choices.first)
    created = int(time.time())
    first = choices.first
    rid = first.request_id
    kind = "chat.completion.chunk" if chat else "text_completion"

    # each choice's characters of the tokens with log probabilities sent so far: a text chunk's text_offset
    offsets = [0] * len(choices.generations)

    def chunk(
        index: int,
        token: TokenChunk | None,
        finish_reason: str | None = None,
        stop: str | None = None,
        *,
        role: bool = False,
    ) -> dict[str, Any]:
        logprobs = token.logprobs if token is not None else ()
        if not chat:
            text = token.text if token is not None else ""
            body = api.text_chunk(rid, model, created, text, finish_reason, stop, logprobs, offsets[index], index)
            offsets[index] += sum(len(entry.token) for entry in logprobs)
        else:
            delta = api.chat_delta(token) if token is not None else {}
            delta = {"role": "assistant", "content": ""} if role else delta
            body = api.chat_chunk(rid, model, created, delta, finish_reason, stop, logprobs, index)
            if include_usage:
                body["usage"] = None
        fingerprint = first.system_fingerprint  # an upstream's, once it has sent one
        return body | ({"system_fingerprint": fingerprint} if fingerprint is not None else {})

    try:
        if chat:
            for index in range(len(choices.generations)):
                await send_data(response, chunk(index, None, role=True))
        async for index, token in _chunks(choices, echo, top):
            if len(token.logprobs) > _MANY_LOGPROBS:  # an echoed prompt's: made and written out off the loop
                await send_data(response, await asyncio.to_thread(chunk, index, token), off_loop=True)
            elif token.text or token.reasoning or token.refusal or token.tool_calls or token.logprobs:
                await send_data(response, chunk(index, token))
            if token.finish_reason is not None:  # the choice's last chunk
                await send_data(response, chunk(index, None, token.finish_reason, token.stop_sequence))
        for index, generation in enumerate(choices.generations):
            if generation.finish_reason is None:  # an upstream's answer that ended without one: its last chunk still
                await send_data(response, chunk(index, None))
        if include_usage:
            await send_data(response, api.usage_chunk(rid, model, created, kind, choices.usage()))
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left request %s; generation stopped", rid)  # the caller's aclose() stops the model
        raise
    except Exception as error:
        _, body = streaming_failure(rid, error)
        await send_event(response, "error", body)
    await choices.aclose()  # usage and timing are final before the stream's end
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
