"""vLLM's `/tokenize` and `/detokenize` routes beside the OpenAI API: a prompt's tokens as the engine computes them
(after canonicalization and layout, through the chat template), and token ids back to text."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import Field

from prefixgate.backends import Backend
from prefixgate.backends.backend import check_token_ids
from prefixgate.errors import RequestError
from prefixgate.proxy.body import parsed
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.openai.api import ChatCompletionRequest, CompletionRequest, Message, Strict, Tool
from prefixgate.proxy.serving import ENGINE, engine_for, prompt_request
from prefixgate.proxy.upstream_engine import UpstreamEngine


class TokenizeRequest(Strict):
    """A POST /tokenize body: a completion's `prompt`, or a chat's `messages` (with its `tools`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as on the chat route
    layout: bool = True  # as on the other routes

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request, as the completions or chat completions route makes it."""
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("send either prompt (a completion's) or messages (a chat's), not both or neither")
        for name in ("tools", "chat_template_kwargs"):
            if getattr(self, name) is not None and self.messages is None:
                raise RequestError(f"{name} go with messages: send messages, or leave {name} out", param=name)
        fields = {"model": self.model or "", "layout": self.layout}
        if self.messages is not None:
            chat_fields = {
                "messages": self.messages,
                "tools": self.tools,
                "chat_template_kwargs": self.chat_template_kwargs,
            }
            chat = ChatCompletionRequest.model_validate(fields | chat_fields)
            return chat.to_prompt_request(tenant)
        return CompletionRequest.model_validate(fields | {"prompt": self.prompt}).to_prompt_request(tenant)


class DetokenizeRequest(Strict):
    """A POST /detokenize body."""

    model: str | None = None
    tokens: list[int]


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize: the prompt's token ids, their count, and the model's context length."""
    body = await parsed(await request.read(), TokenizeRequest)
    engine = _local(request, body.model)
    prepared = await engine.prepare(await prompt_request(request, body))
    tokens = list(prepared.token_ids)
    return web.json_response({"count": len(tokens), "max_model_len": engine.context_length, "tokens": tokens})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: the text of token ids, special tokens included."""
    body = await parsed(await request.read(), DetokenizeRequest)
    backend = _local(request, body.model).backend
    # Off the loop: decoding takes time in proportion to the tokens, and a body may hold millions.
    return web.json_response({"prompt": await asyncio.to_thread(_decode, backend, body.tokens)})


def _decode(backend: Backend, tokens: list[int]) -> str:
    check_token_ids(tokens, backend.vocab_size, param="tokens")
    return backend.decode(tokens, skip_special_tokens=False)


def _local(request: web.Request, model: str | None) -> Engine:
    """Return the engine of the model named (or the one served, when none is); raise RequestError before upstreams."""
    engine = request.app[ENGINE] if model is None else engine_for(request, model)
    if isinstance(engine, UpstreamEngine):
        raise RequestError(f"{request.path} needs the model's tokenizer, and this server forwards to upstreams")
    return engine
