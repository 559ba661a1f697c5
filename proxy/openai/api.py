"""The OpenAI API's request shapes (validated with pydantic) and the response bodies and chunks we send back."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixgate.backends import SamplingParams, TokenChunk, TokenLogprob, ToolCallDelta, TopLogprob
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import Answer
from prefixgate.proxy.engine import Breakpoint, PromptRequest, Usage

# What an unset max_tokens means: OpenAI runs to the context's end; a CPU proxy stops earlier, and says so in /docs.
DEFAULT_MAX_TOKENS = 512
# Every generated token is checked against every stop string, and text that could begin one is held back: bounded, so
# that no request's stop strings cost the model thread more than a little per token. OpenAI takes up to 4.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 256
# Choices of one request (`n`): each is a stream of its own on the prompt, held once (OpenAI takes up to 128).
MAX_CHOICES = 16
# vLLM's and SGLang's request fields that prefixgate does not act on: passed on to upstreams, refused locally.
_EXTENSIONS = (
    "repetition_penalty",
    "min_p",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "bad_words",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structured_outputs",
    "regex",
    "ebnf",
    "no_stop_trim",
)


class Strict(BaseModel):
    # An unknown field is an error: silently ignoring one could change the answer without the client knowing. So is a
    # value of the wrong type (`"max_tokens": "2"`, `"stream": "false"`), as OpenAI and Anthropic refuse it.
    model_config = ConfigDict(extra="forbid", strict=True)


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
    # An answer's reasoning, sent back with it (vLLM's names; the openai client's dump of an answer carries both). It
    # goes to the chat template as `reasoning_content`, which reasoning models' templates render.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        for index, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {index} is of type {kind!r}: this server takes text parts; send text")
        return value

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not self.tool_calls:
            article = "an" if self.role == "assistant" else "a"
            needs = "content or tool_calls" if self.role == "assistant" else "content"
            raise ValueError(f"{article} {self.role} message needs {needs}")
        if self.role != "assistant" and (self.reasoning_content is not None or self.reasoning is not None):
            raise ValueError(f"a {self.role} message carries no reasoning; only the assistant's answers do")
        if self.reasoning_content is None:
            self.reasoning_content, self.reasoning = self.reasoning, None
        else:
            self.reasoning = None  # one text: reasoning_content's
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
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)  # extensions vLLM and SGLang accept
    ignore_eos: bool = False
    # vLLM's: each prompt token's log probability with this many alternatives, answered whole (the prompt computed)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None  # it does not change the answer; before upstreams, a routing hint
    prompt_cache_key: str | None = None  # prefixes are found by content; before upstreams, a routing hint
    # "24h" keeps the prompt's blocks at least a day; "in_memory" (or none) leaves them to the tiers' policies.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # splits this tenant's cache further
    layout: bool = True  # false keeps per-request content where the client put it
    # _EXTENSIONS: passed on to upstreams as sent, refused by a local model.
    repetition_penalty: float | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    regex: str | None = None  # SGLang's constraints
    ebnf: str | None = None
    no_stop_trim: bool | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"send at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(len(string) > MAX_STOP_CHARACTERS for string in strings):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARACTERS} characters; shorten it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids, as strings of digits; got {key!r}")
        return value

    def sampling_params(
        self, max_tokens: int | None, *, logprobs: bool = False, top_logprobs: int = 0
    ) -> SamplingParams:
        """Return the sampling parameters."""
        if self.stream_options is not None and not self.stream:
            raise RequestError(
                'stream_options is only allowed when stream is true; set "stream": true or leave it out',
                param="stream_options",
            )
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError(
                "prompt_logprobs comes with a whole answer; leave out stream or prompt_logprobs",
                param="prompt_logprobs",
            )
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
        )

    def extensions(self) -> dict[str, Any]:
        """Return the fields set that only upstreams act on (see `_EXTENSIONS`), as sent."""
        return {name: getattr(self, name) for name in _EXTENSIONS if getattr(self, name) is not None}

    def breakpoints(self) -> tuple[Breakpoint, ...]:
        """Return the retention the client asks for: "24h" keeps the whole prompt at least a day."""
        return (Breakpoint(24 * 3600.0),) if self.prompt_cache_retention == "24h" else ()


class NamedFunction(Strict):
    """The function a named tool_choice names."""

    name: str


class NamedToolChoice(Strict):
    """A tool_choice that names the function the model must call."""

    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(BaseModel):
    """A response_format: text, any JSON object, or JSON matching a schema; its other fields pass on as sent."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and not isinstance((self.json_schema or {}).get("name"), str):
            raise ValueError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        schema = (self.json_schema or {}).get("schema")
        if self.type == "json_schema" and schema is not None and not isinstance(schema, dict):
            sent = json.dumps(schema)[:40]
            raise ValueError(f'response_format json_schema "schema" must be a JSON Schema object, not {sent}')
        return self


class ChatCompletionRequest(_Generation):
    """A POST /v1/chat/completions body."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    # A named function; or the newer forms (allowed_tools, custom) for upstreams that take them, as sent.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None  # accepted; stored nowhere
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None  # passed on to upstreams; a local model does not reason
    # vLLM's and SGLang's: the chat template's other variables (Qwen3's enable_thinking, say)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tool_choice")
    @classmethod
    def _known_choice(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") not in ("allowed_tools", "custom"):
            raise ValueError(
                'tool_choice is "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
            )
        return value

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request."""
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise RequestError(
                f"tool_choice {self._choice_name()} needs tools; send tools or leave it out", param="tool_choice"
            )
        messages = [message.model_dump(exclude_none=True) for message in self.messages]
        tool_choice = (
            self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        )
        extensions = self.extensions()
        if self.reasoning_effort is not None:
            extensions["reasoning_effort"] = self.reasoning_effort
        return PromptRequest(
            params=self.sampling_params(
                self.max_completion_tokens or self.max_tokens,
                logprobs=self.logprobs,
                top_logprobs=self.top_logprobs or 0,
            ),
            messages=messages,
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=self.prompt_cache_key or self.user,
            breakpoints=self.breakpoints(),
            template_kwargs=self.chat_template_kwargs or {},
            tool_choice=tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self.response_format.model_dump(exclude_none=True) if self.response_format else None,
            extensions=extensions,
        )

    def _choice_name(self) -> str:
        return repr(self.tool_choice) if isinstance(self.tool_choice, str) else "naming a tool"


class CompletionRequest(_Generation):
    """A POST /v1/completions body."""

    # Text, or token ids (as vLLM takes them, from its /tokenize, say); one prompt, alone or in a list of one.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt before the answer; with logprobs, its tokens' too (the whole prompt computed)
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy form: how many top tokens, besides the chosen one

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request, refusing what this server cannot honour."""
        prompt = self.sent_prompt()
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        if self.suffix:
            raise RequestError("suffix is not supported; leave it out", param="suffix")
        if self.best_of not in (None, 1):
            raise RequestError("best_of is not supported; leave it out or set it to 1", param="best_of")
        params = self.sampling_params(
            self.max_tokens, logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0
        )
        if self.echo and self.logprobs is not None:  # the prompt's columns: as many alternatives as either field asks
            params = replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return PromptRequest(
            params=params,
            prompt=prompt,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=self.prompt_cache_key or self.user,
            breakpoints=self.breakpoints(),
            extensions=self.extensions(),
        )

    def sent_prompt(self) -> str | tuple[int, ...]:
        """Return the one prompt sent: its text, or its token ids."""
        sent = self.prompt
        if isinstance(sent, str):
            return sent
        if not sent or isinstance(sent[0], int):
            return tuple(cast(list[int], sent))  # validated: every element an int
        if len(sent) != 1:
            raise RequestError("send one prompt per request (a string, or a list of token ids)", param="prompt")
        (one,) = sent
        return one if isinstance(one, str) else tuple(one)


def sampling_fields(model: str, params: SamplingParams, *, chat: bool) -> dict[str, Any]:
    """Return the body fields that ask an OpenAI-compatible server for `model` with these sampling parameters (for
    the chat API, or with `chat` false the completions API); what is off is left out, for servers that know only
    OpenAI's fields."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    optional = {
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(params.stop),
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "logit_bias": {str(token): bias for token, bias in params.logit_bias},
        "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos,
    }
    body |= {name: value for name, value in optional.items() if value or (name == "seed" and value is not None)}
    if params.logprobs and chat:
        body |= {"logprobs": True} | ({"top_logprobs": params.top_logprobs} if params.top_logprobs else {})
    elif params.logprobs:
        body["logprobs"] = params.top_logprobs
    return body


def usage_body(usage: Usage) -> dict[str, Any]:
    """Return OpenAI's usage object, with the cached prompt tokens."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def chat_completion(
    request_id: str,
    model: str,
    choices: Sequence[tuple[Answer, str]],
    usage: Usage,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Return a whole chat completion body of each choice's answer and finish reason, in order; a choice's
    `stop_reason` is the stop string that ended it, as vLLM reports it."""
    rendered = [_chat_choice(index, answer, finish_reason) for index, (answer, finish_reason) in enumerate(choices)]
    return _completion(request_id, "chat.completion", model, rendered, fingerprint) | {"usage": usage_body(usage)}


def _chat_choice(index: int, answer: Answer, finish_reason: str) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": answer.text if answer.text or not answer.tool_calls else None,
        "refusal": answer.refusal or None,
    }
    if answer.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in answer.tool_calls
        ]
    if answer.reasoning:
        message |= _reasoning(answer.reasoning)
    return {
        "index": index,
        "message": message,
        "logprobs": chat_logprobs(answer.logprobs),
        "finish_reason": finish_reason,
        "stop_reason": answer.stop_sequence,
    }


def text_completion(
    request_id: str,
    model: str,
    choices: Sequence[tuple[Answer, str]],
    usage: Usage,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Return a whole text completion body, its choices as in `chat_completion`."""
    rendered = [
        _text_choice(index, answer.text, finish_reason, answer.stop_sequence, answer.logprobs)
        for index, (answer, finish_reason) in enumerate(choices)
    ]
    return _completion(request_id, "text_completion", model, rendered, fingerprint) | {"usage": usage_body(usage)}


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    stop_reason: str | None = None,
    logprobs: tuple[TokenLogprob, ...] = (),
    index: int = 0,
) -> dict[str, Any]:
    """Return one chat.completion.chunk of choice `index`; a choice's last one has its finish reason, and
    `stop_reason` as in `chat_completion`."""
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(logprobs),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_delta(chunk: TokenChunk) -> dict[str, Any]:
    """Return the delta of a chat chunk for what one of the engine's chunks carries (empty when it carries none)."""
    delta: dict[str, Any] = {}
    if chunk.text:
        delta["content"] = chunk.text
    if chunk.reasoning:
        delta |= _reasoning(chunk.reasoning)
    if chunk.refusal:
        delta["refusal"] = chunk.refusal
    if chunk.tool_calls:
        delta["tool_calls"] = [_tool_call_delta(piece) for piece in chunk.tool_calls]
    return delta


def text_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | None = None,
    logprobs: tuple[TokenLogprob, ...] = (),
    offset: int = 0,
    index: int = 0,
) -> dict[str, Any]:
    """Return one streamed text_completion chunk of choice `index`; `stop_reason` as in `chat_completion`; `offset`:
    the characters of the choice's tokens in its chunks before (where this chunk's `text_offset` counts from)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_text_choice(index, text, finish_reason, stop_reason, logprobs, offset)],
    }


def prompt_logprobs(entries: Sequence[TokenLogprob], top: int) -> list[dict[str, dict[str, Any]] | None]:
    """Return vLLM's `prompt_logprobs`: for each prompt token after the first (None), its log probability, rank and
    text, and `top` alternatives, by token id."""
    scored: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries[1:]:
        alternatives: list[TopLogprob | TokenLogprob] = [*entry.top[:top], entry]
        scored.append(
            {
                str(each.token_id): {"logprob": each.logprob, "rank": each.rank, "decoded_token": each.token}
                for each in alternatives
            }
        )
    return scored


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
    """Return the chat API's logprobs object, or None when there are none."""
    if not logprobs:
        return None
    return {"content": logprob_entries(logprobs), "refusal": None}


def logprob_entries(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Return each token's log probability with its top alternatives, as the chat API's `logprobs.content` and the
    Responses API's `output_text.logprobs` give them."""
    return [
        {
            "token": entry.token,
            "logprob": entry.logprob,
            "bytes": _byte_list(entry.bytes),
            "top_logprobs": [
                {"token": top.token, "logprob": top.logprob, "bytes": _byte_list(top.bytes)} for top in entry.top
            ],
        }
        for entry in logprobs
    ]


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


def _text_choice(
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | None,
    logprobs: tuple[TokenLogprob, ...],
    offset: int = 0,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": _text_logprobs(logprobs, offset),
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def _text_logprobs(logprobs: tuple[TokenLogprob, ...], offset: int = 0) -> dict[str, Any] | None:
    """Return the completions API's logprobs columns; `text_offset` counts from the answer's start, where the first
    of these tokens is at `offset`."""
    if not logprobs:
        return None
    offsets = [offset]
    for entry in logprobs[:-1]:
        offsets.append(offsets[-1] + len(entry.token))
    return {
        "tokens": [entry.token for entry in logprobs],
        "token_logprobs": [entry.logprob for entry in logprobs],
        # an echoed prompt's first token has no log probability, and no alternatives
        "top_logprobs": [
            None if entry.logprob is None else {top.token: top.logprob for top in entry.top} for entry in logprobs
        ],
        "text_offset": offsets,
    }


def _completion(
    request_id: str, kind: str, model: str, choices: list[dict[str, Any]], fingerprint: str | None
) -> dict[str, Any]:
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    return body | ({"system_fingerprint": fingerprint} if fingerprint is not None else {})


def _reasoning(text: str) -> dict[str, str]:
    # vLLM and SGLang name it reasoning_content, newer vLLM also reasoning: clients read one or the other.
    return {"reasoning_content": text, "reasoning": text}


def _tool_call_delta(piece: ToolCallDelta) -> dict[str, Any]:
    function = ({"name": piece.name} if piece.name is not None else {}) | {"arguments": piece.arguments}
    delta: dict[str, Any] = {"index": piece.index}
    if piece.id is not None:
        delta |= {"id": piece.id, "type": "function"}
    return delta | {"function": function}


def _byte_list(value: tuple[int, ...] | None) -> list[int] | None:
    return None if value is None else list(value)
