"""The Anthropic routes `/v1/messages` and `/v1/messages/count_tokens`: a Messages body generated on the engine,
answered whole or streamed as Anthropic's events; `max_tokens: 0` fills the cache and answers nothing."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from prefixgate.backends import TokenChunk
from prefixgate.backends.tool_calls import call_id
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import Answer, assemble
from prefixgate.proxy.anthropic import api
from prefixgate.proxy.body import parsed
from prefixgate.proxy.choices import AnyGeneration
from prefixgate.proxy.engine import Usage
from prefixgate.proxy.serving import answer_headers, engine_for, open_stream, prompt_request, relay, send_event, start
from prefixgate.proxy.upstream_engine import UpstreamEngine


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: Anthropic's Messages API on the same engine."""
    body = await parsed(await request.read(), api.MessagesRequest)
    if body.max_tokens == 0:
        return await _prewarm(request, body)
    choices = await start(request, body.model, await prompt_request(request, body), prompt_param="messages")
    generation = choices.first  # the Messages API answers once
    message_id = api.message_id()
    if body.stream:
        async with choices:
            return await _stream_message(request, generation, body.model, message_id)
    async with choices:
        answer = assemble([chunk async for chunk in generation])
    payload = api.message(message_id, body.model, answer, generation.finish_reason, generation.usage())
    return web.json_response(payload, headers=answer_headers(generation))


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt tokens of a Messages body, as this server renders it."""
    body = await parsed(await request.read(), api.CountTokensRequest)
    engine = engine_for(request, body.model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError("counting tokens needs the model's tokenizer, and this server forwards to upstreams")
    prepared = await engine.prepare(await prompt_request(request, body))
    return web.json_response({"input_tokens": len(prepared.token_ids)})


async def _prewarm(request: web.Request, body: api.MessagesRequest) -> web.Response:
    """Answer `max_tokens: 0`: compute and store the prompt (its breakpoints kept as asked), generate nothing."""
    if body.stream:
        raise RequestError("max_tokens 0 fills the cache and answers nothing: send it without stream", param="stream")
    engine = engine_for(request, body.model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError(
            "max_tokens 0 fills a cache of this server's own, and this one forwards to upstreams", param="max_tokens"
        )
    warmed = await engine.warm(await prompt_request(request, body))
    usage = Usage(warmed.prompt_tokens, 0, warmed.read_tokens, {}, warmed.cache_writes)
    empty = Answer("", "", "", (), (), None)
    return web.json_response(api.message(api.message_id(), body.model, empty, "length", usage))


async def _stream_message(
    request: web.Request, generation: AnyGeneration, model: str, message_id: str
) -> web.StreamResponse:
    """Send the generation as Anthropic's stream events, in Anthropic's order; the caller closes the generation."""
    response = await open_stream(request, generation)
    start_body = api.message(message_id, model, None, None, generation.usage())
    await send_event(response, "message_start", {"type": "message_start", "message": start_body})
    await send_event(response, "ping", {"type": "ping"})
    blocks = _ContentBlocks(response)

    async def fail(status: int, message: str) -> None:
        await send_event(response, "error", api.error_body(status, message))

    if not await relay(response, generation, message_id, blocks.add, fail):
        return response
    await blocks.close()
    await generation.aclose()  # usage is final
    stop = blocks.stop
    reason = api.stop_reason(generation.finish_reason, stop)
    usage = api.usage_body(generation.usage())
    end: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop}}
    await send_event(response, "message_delta", end | {"usage": usage})
    await send_event(response, "message_stop", {"type": "message_stop"})
    await response.write_eof()
    return response


class _ContentBlocks:
    """Anthropic's content blocks of a streamed answer, each opened as its content starts and closed before the next:
    reasoning as thinking, text, and each tool call as tool_use, its arguments as input_json_delta pieces."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._index = -1
        self._open: str | int | None = None  # "thinking", "text", or the index of the tool call being streamed
        self.stop: str | None = None  # the stop string that ended the answer, once one has

    async def add(self, token: TokenChunk) -> None:
        """Send what one of the engine's chunks carries."""
        self.stop = token.stop_sequence
        if token.reasoning:
            await self._delta(
                "thinking",
                {"type": "thinking", "thinking": "", "signature": ""},
                {"type": "thinking_delta", "thinking": token.reasoning},
            )
        if token.text:
            await self._delta("text", {"type": "text", "text": ""}, {"type": "text_delta", "text": token.text})
        for piece in token.tool_calls:
            block = api.tool_use(piece.id or call_id(), piece.name or "", "{}")
            delta = {"type": "input_json_delta", "partial_json": piece.arguments} if piece.arguments else None
            await self._delta(piece.index, block, delta)

    async def close(self) -> None:
        """Close the block still open."""
        if self._open is not None:
            stop = {"type": "content_block_stop", "index": self._index}
            await send_event(self._response, "content_block_stop", stop)
            self._open = None

    async def _delta(self, kind: str | int, block: dict[str, Any], delta: dict[str, Any] | None) -> None:
        if kind != self._open:
            await self.close()
            self._index += 1
            self._open = kind
            start_body = {"type": "content_block_start", "index": self._index, "content_block": block}
            await send_event(self._response, "content_block_start", start_body)
        if delta is not None:
            piece = {"type": "content_block_delta", "index": self._index, "delta": delta}
            await send_event(self._response, "content_block_delta", piece)
