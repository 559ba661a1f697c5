"""The OpenAI route `/v1/responses`: a Responses API body generated on the engine as the chat completion it stands for,
answered as output items, whole or streamed as the Responses API's numbered events."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from prefixgate.backends import TokenChunk, TokenLogprob
from prefixgate.backends.tool_calls import call_id
from prefixgate.proxy.answer import assemble
from prefixgate.proxy.body import parsed
from prefixgate.proxy.choices import AnyGeneration
from prefixgate.proxy.openai import responses as api
from prefixgate.proxy.openai.api import logprob_entries
from prefixgate.proxy.serving import answer_headers, open_stream, prompt_request, relay, send_event, start


async def responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: OpenAI's Responses API on the same engine, stateless (see `responses`)."""
    body = await parsed(await request.read(), api.ResponsesRequest)
    choices = await start(request, body.model, await prompt_request(request, body), prompt_param="input")
    generation = choices.first  # the Responses API answers once
    rid, created = api.response_id(), float(int(time.time()))
    if body.stream:
        async with choices:
            return await _stream_response(request, generation, body, rid, created)
    async with choices:
        chunks = [chunk async for chunk in generation]
    items = api.output_items(assemble(chunks), api.message_logprobs(chunks))
    thought = sum(1 for chunk in chunks if chunk.reasoning)
    usage = generation.usage()
    payload = api.response(body, rid, created, items, generation.finish_reason, usage, thought)
    return web.json_response(payload, headers=answer_headers(generation))


async def _stream_response(
    request: web.Request, generation: AnyGeneration, body: api.ResponsesRequest, rid: str, created: float
) -> web.StreamResponse:
    """Send the generation as the Responses API's stream events, in their order; the caller closes the generation."""
    response = await open_stream(request, generation)
    items = _OutputItems(response)
    begun = {"response": api.response(body, rid, created, [], None, None)}
    await items.event("response.created", begun)
    await items.event("response.in_progress", begun)

    async def fail(status: int, message: str) -> None:
        await items.event(
            "error", {"code": "server_error" if status >= 500 else "invalid_request_error", "message": message}
        )

    if not await relay(response, generation, rid, items.add, fail):
        return response
    await items.close()
    await generation.aclose()  # usage is final
    usage = generation.usage()
    done = api.response(body, rid, created, items.done, generation.finish_reason, usage, items.thought)
    await items.event(
        "response.completed" if done["status"] == "completed" else "response.incomplete", {"response": done}
    )
    await response.write_eof()
    return response


class _OutputItems:
    """The Responses API's output items of a streamed answer, each added as its content begins and done before the
    next: reasoning, the message's text, and each tool call, its arguments in pieces."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._sequence = 0
        self.done: list[dict[str, Any]] = []  # the items done, in order
        self.thought = 0  # the answer's tokens that carried reasoning
        self._item: dict[str, Any] | None = None  # the item being streamed
        self._kind: str | int | None = None  # "reasoning", "text", or the index of the tool call being streamed
        self._text = ""  # what the item has streamed
        self._logprobs: list[TokenLogprob] = []  # the message's tokens' log probabilities, sent and not yet sent
        self._sent = 0  # how many of them went with a text delta

    async def event(self, kind: str, body: dict[str, Any]) -> None:
        """Send one event, numbered in the stream."""
        await send_event(self._response, kind, {"type": kind, "sequence_number": self._sequence} | body)
        self._sequence += 1

    async def add(self, token: TokenChunk) -> None:
        """Send what one of the engine's chunks carries."""
        self._logprobs += api.message_logprobs([token])
        if token.reasoning:
            self.thought += 1
            if self._kind != "reasoning":
                await self._begin("reasoning", api.reasoning_item(api.item_id("rs"), ""))
            await self._delta("response.reasoning_text.delta", token.reasoning)
        if token.text:
            if self._kind != "text":
                await self._begin("text", api.message_item(api.item_id("msg"), None, "in_progress"))
            unsent, self._sent = self._logprobs[self._sent :], len(self._logprobs)
            await self._delta("response.output_text.delta", token.text, logprobs=logprob_entries(unsent))
        for piece in token.tool_calls:
            if self._kind != piece.index:
                call = (piece.id or call_id(), piece.name or "", "", "in_progress")
                await self._begin(piece.index, api.call_item(api.item_id("fc"), *call))
            if piece.arguments:
                await self._delta("response.function_call_arguments.delta", piece.arguments)

    async def close(self) -> None:
        """Finish the item still open; an answer with none sends an empty message, as a whole one has."""
        if not self.done and self._item is None:
            await self._begin("text", api.message_item(api.item_id("msg"), None, "in_progress"))
        await self._finish()

    async def _begin(self, kind: str | int, item: dict[str, Any]) -> None:
        await self._finish()
        self._kind, self._item, self._text = kind, item, ""
        where = self._where()
        await self.event("response.output_item.added", {"output_index": where["output_index"], "item": item})
        part = self._part("")
        if part is not None:
            await self.event("response.content_part.added", where | {"content_index": 0, "part": part})

    async def _delta(self, kind: str, delta: str, **extra: Any) -> None:
        self._text += delta
        index = {} if kind == "response.function_call_arguments.delta" else {"content_index": 0}
        await self.event(kind, self._where() | index | {"delta": delta} | extra)

    async def _finish(self) -> None:
        item = self._item
        if item is None:
            return
        where = self._where()
        if item["type"] == "function_call":
            item |= {"arguments": self._text, "status": "completed"}
            done = {"arguments": self._text, "name": item["name"]}
            await self.event("response.function_call_arguments.done", where | done)
        else:
            part = self._part(self._text, self._logprobs)
            assert part is not None
            kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            message = item["type"] == "message"
            text: dict[str, Any] = {"text": self._text} | ({"logprobs": part["logprobs"]} if message else {})
            await self.event(kind, where | {"content_index": 0} | text)
            await self.event("response.content_part.done", where | {"content_index": 0, "part": part})
            item["content"] = [part]
            if message:
                item["status"] = "completed"
                self._logprobs, self._sent = [], 0  # the next message's are its own
        await self.event("response.output_item.done", {"output_index": where["output_index"], "item": item})
        self.done.append(item)
        self._item, self._kind = None, None

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.done)}

    def _part(self, text: str, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any] | None:
        """Return the item's content part holding `text` (a message's with its tokens' `logprobs`): none for a tool
        call."""
        assert self._item is not None
        if self._item["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        if self._item["type"] == "message":
            return api.output_text(text, logprobs or ())
        return None
