"""The OpenAI API's request shapes (validated with pydantic) and the response bodies and chunks we send back."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixgate.backends import SamplingParams
from prefixgate.errors import RequestError
from prefixgate.proxy.engine import Breakpoint, PromptRequest, Usage

_Body = TypeVar("_Body", bound=BaseModel)

# What an unset max_tokens means: OpenAI runs to the context's end; a CPU proxy stops earlier, and says so in /docs.
DEFAULT_MAX_TOKENS = 512
MAX_JSON_DEPTH = 64  # lists and objects within each other; real tool schemas nest a dozen levels at most
# Every generated token is checked against every stop string, and text that could begin one is held back: bounded, so
# that no request's stop strings cost the model thread more than a little per token. OpenAI takes up to 4.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 256


class Strict(BaseModel):
    # An unknown field is an error: silently ignoring one could change the answer without the client knowing.
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    """One text part of a message's content."""

    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    """A function the assistant called."""

    name: str
    arguments: str


class ToolCall(Strict):
    """A tool call in an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(Strict):
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    """A tool definition."""

    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(Strict):
    """Streaming options."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Generation(Strict):
    """Fields shared by chat and text completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension vLLM and llama.cpp accept too
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # it does not change the answer; before upstreams, a routing hint
    prompt_cache_key: str | None = None  # prefixes are found by content; before upstreams, a routing hint
    # "24h" keeps the prompt's blocks at least a day; "in_memory" (or none) leaves them to the tiers' policies.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # splits this tenant's cache further
    layout: bool = True  # false keeps per-request content where the client put it

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"send at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(len(string) > MAX_STOP_CHARACTERS for string in strings):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARACTERS} characters; shorten it")
        return value

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Return the sampling parameters, refusing fields that would change the answer and are not supported."""
        for name, value in (("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)):
            if value:
                raise RequestError(f"{name} is not supported; leave it out or set it to 0", param=name)
        if self.logit_bias:
            raise RequestError("logit_bias is not supported; leave it out", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                'stream_options is only allowed when stream is true; set "stream": true or leave it out',
                param="stream_options",
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            n=self.n,
        )

    def breakpoints(self) -> tuple[Breakpoint, ...]:
        """Return the retention the client asks for: "24h" keeps the whole prompt at least a day."""
        return (Breakpoint(24 * 3600.0),) if self.prompt_cache_retention == "24h" else ()


class ChatCompletionRequest(_Generation):
    """A POST /v1/chat/completions body."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None  # accepted; stored nowhere
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request, refusing what this server cannot honour."""
        if self.logprobs or self.top_logprobs:
            raise RequestError("logprobs are not supported; leave logprobs out or set it to false", param="logprobs")
        if self.response_format and self.response_format.get("type") != "text":
            raise RequestError("only response_format {'type': 'text'} is supported", param="response_format")
        if self.reasoning_effort is not None:
            raise RequestError(
                "reasoning_effort is not supported by this model; leave it out", param="reasoning_effort"
            )
        messages = [message.model_dump(exclude_none=True) for message in self.messages]
        tools = (
            None
            if self.tool_choice == "none" or not self.tools
            else [t.model_dump(exclude_none=True) for t in self.tools]
        )
        return PromptRequest(
            params=self.sampling_params(self.max_completion_tokens or self.max_tokens),
            messages=messages,
            tools=tools,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=self.prompt_cache_key or self.user,
            breakpoints=self.breakpoints(),
        )


class CompletionRequest(_Generation):
    """A POST /v1/completions body."""

    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request, refusing what this server cannot honour."""
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise RequestError("send one prompt per request (a string)", param="prompt")
            prompt = self.prompt[0]
        else:
            prompt = self.prompt
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        for name, value in (("echo", self.echo), ("suffix", self.suffix), ("logprobs", self.logprobs)):
            if value:
                raise RequestError(f"{name} is not supported; leave it out", param=name)
        if self.best_of not in (None, 1):
            raise RequestError("best_of is not supported; leave it out or set it to 1", param="best_of")
        return PromptRequest(
            params=self.sampling_params(self.max_tokens),
            prompt=prompt,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=self.prompt_cache_key or self.user,
            breakpoints=self.breakpoints(),
        )


def sampling_fields(model: str, params: SamplingParams) -> dict[str, Any]:
    """Return the body fields that ask an OpenAI-compatible server for `model` with these sampling parameters."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.top_k:  # an extension: left out when off, for servers that know only OpenAI's fields
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    return body


def parse_json(raw: bytes, model: type[_Body]) -> _Body:
    """Return a JSON request body validated as `model`; raise RequestError when it is not a JSON object."""
    return model.model_validate(json_object(raw))


def json_object(raw: bytes) -> dict[str, Any]:
    """Return a request body's JSON object; raise RequestError when it is not one."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise RequestError(f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels are accepted") from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    # Every later step (validation, canonical tool JSON, the chat template) walks the body recursively.
    if _depth(data) > MAX_JSON_DEPTH:
        raise RequestError(f"the request body nests too deeply; at most {MAX_JSON_DEPTH} levels are accepted")
    return data


def _depth(value: Any) -> int:
    """Return how deeply lists and objects nest in a JSON value, without recursion (linear in its size)."""
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def usage_body(usage: Usage) -> dict[str, Any]:
    """Return OpenAI's usage object, with the cached prompt tokens."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion(
    request_id: str, model: str, text: str, finish_reason: str, usage: Usage, stop_reason: str | None = None
) -> dict[str, Any]:
    """Return a whole chat completion body; `stop_reason` is the stop string that ended it, as vLLM reports it."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
        "usage": usage_body(usage),
    }


def text_completion(
    request_id: str, model: str, text: str, finish_reason: str, usage: Usage, stop_reason: str | None = None
) -> dict[str, Any]:
    """Return a whole text completion body; `stop_reason` as in `chat_completion`."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_text_choice(text, finish_reason, stop_reason)],
        "usage": usage_body(usage),
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    stop_reason: str | None = None,
) -> dict[str, Any]:
    """Return one chat.completion.chunk; the last one has the finish reason, and `stop_reason` as in
    `chat_completion`."""
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
        ],
    }


def text_chunk(
    request_id: str, model: str, created: int, text: str, finish_reason: str | None, stop_reason: str | None = None
) -> dict[str, Any]:
    """Return one streamed text_completion chunk; `stop_reason` as in `chat_completion`."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_text_choice(text, finish_reason, stop_reason)],
    }


def usage_chunk(request_id: str, model: str, created: int, kind: str, usage: Usage) -> dict[str, Any]:
    """Return the final usage chunk sent when `stream_options.include_usage` is set."""
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body(usage),
    }


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """Return OpenAI's error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _text_choice(text: str, finish_reason: str | None, stop_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": stop_reason}
