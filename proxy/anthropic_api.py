"""The Anthropic Messages API's request shapes (validated with pydantic), their translation to the engine's request,
and the bodies and stream events we send back, as Anthropic's clients expect them."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prefixgate.backends import SamplingParams
from prefixgate.errors import RequestError
from prefixgate.proxy.engine import Breakpoint, PromptRequest, Usage
from prefixgate.proxy.openai_api import MAX_STOP_CHARACTERS, MAX_STOP_STRINGS, Strict

MAX_BREAKPOINTS = 4  # cache_control breakpoints per request, as Anthropic allows
# The error type Anthropic names for each status; any other 4xx is an invalid request, any other 5xx an API error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}  # how long a cache_control breakpoint keeps its prefix, at least


class CacheControl(Strict):
    """A cache breakpoint: the prompt up to the end of the block that carries it is kept at least `ttl`."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        """Return the ttl in seconds."""
        return TTL_SECONDS[self.ttl]


class TextBlock(Strict):
    """One text content block."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class MessageParam(Strict):
    """One message of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for index, block in enumerate(value if isinstance(value, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(
                    f"block {index} is of type {kind!r}: this server takes text content blocks only; send the content "
                    "as text"
                )
        return value


class ToolParam(Strict):
    """A tool the model may call, in Anthropic's shape."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class Metadata(Strict):
    """Request metadata: an opaque id of the end user."""

    user_id: str | None = Field(None, max_length=256)


class MessagesRequest(Strict):
    """A POST /v1/messages body."""

    model: str
    max_tokens: int = Field(ge=0)  # 0: fill the prompt cache (pre-warm) and answer nothing
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    temperature: float = Field(1.0, ge=0.0, le=1.0)  # sampling fields older clients send, and open models take
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[ToolParam] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: CacheControl | None = None  # a breakpoint on the last block that can take one
    service_tier: str | None = None  # accepted; there is one tier here
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # prefixgate's: splits this tenant's cache
    layout: bool = True  # prefixgate's: false keeps per-request content where the client put it

    @field_validator("stop_sequences")
    @classmethod
    def _bounded_stops(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"send at most {MAX_STOP_STRINGS} stop sequences, got {len(value)}")
        if any(not stop or len(stop) > MAX_STOP_CHARACTERS for stop in value or ()):
            raise ValueError(f"each stop sequence needs 1 to {MAX_STOP_CHARACTERS} characters")
        return value

    @model_validator(mode="after")
    def _breakpoints(self) -> MessagesRequest:
        """Check the cache breakpoints as Anthropic does: at most four, and no 1h one after a 5m one."""
        marked = [block.cache_control for block in self._blocks()] + [self.cache_control]
        ttls = [control.ttl for control in marked if control is not None]
        if len(ttls) > MAX_BREAKPOINTS:
            raise ValueError(f"a request may have at most {MAX_BREAKPOINTS} cache_control breakpoints, got {len(ttls)}")
        if "5m" in ttls and "1h" in ttls[ttls.index("5m") :]:
            raise ValueError(
                'a cache_control breakpoint with ttl "1h" must not come after one with ttl "5m" (tools, then system, '
                "then messages); put the longer-lived ones first"
            )
        return self

    def _blocks(self) -> list[ToolParam | TextBlock]:
        """Return every block that may carry a breakpoint, in prompt order: tools, system, messages."""
        blocks: list[ToolParam | TextBlock] = list(self.tools or ())
        blocks += self.system if isinstance(self.system, list) else []
        for message in self.messages:
            blocks += message.content if isinstance(message.content, list) else []
        return blocks

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request: the system prompt first, the text blocks as text parts, the tools as
        OpenAI function tools for the chat template."""
        choice = (self.tool_choice or {}).get("type", "auto")
        if choice not in ("auto", "none"):
            raise RequestError(
                f"tool_choice {choice!r} is not supported: the answer comes back as text; use auto or none",
                param="tool_choice",
            )
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _content(self.system)})
        messages += [{"role": message.role, "content": _content(message.content)} for message in self.messages]
        tools = None
        if self.tools and choice != "none":
            tools = [
                {
                    "type": "function",
                    "function": {"name": tool.name, "parameters": tool.input_schema}
                    | ({"description": tool.description} if tool.description is not None else {}),
                }
                for tool in self.tools
            ]
        params = SamplingParams(
            max_tokens=max(1, self.max_tokens),  # a pre-warm (0) generates nothing: the engine warms instead
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop_sequences or ()),
        )
        hint = self.metadata.user_id if self.metadata is not None else None
        return PromptRequest(
            params=params,
            messages=messages,
            tools=tools,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=hint,
            breakpoints=self._placed_breakpoints(tools is not None),
        )

    def _placed_breakpoints(self, with_tools: bool) -> tuple[Breakpoint, ...]:
        """Return the cache_control breakpoints, placed in the engine's request (the system prompt is message 0)."""
        points: list[Breakpoint] = []
        for index, tool in enumerate(self.tools or ()):
            if tool.cache_control is not None and with_tools:
                points.append(Breakpoint(tool.cache_control.seconds, tool=index))
        first = 0
        if self.system:
            first = 1
            for part, block in enumerate(self.system if isinstance(self.system, list) else ()):
                if block.cache_control is not None:
                    points.append(Breakpoint(block.cache_control.seconds, message=0, part=part))
        for index, message in enumerate(self.messages):
            for part, block in enumerate(message.content if isinstance(message.content, list) else ()):
                if block.cache_control is not None:
                    points.append(Breakpoint(block.cache_control.seconds, message=first + index, part=part))
        if self.cache_control is not None:  # on the last block that can take one: the whole prompt
            points.append(Breakpoint(self.cache_control.seconds))
        return tuple(points)


class CountTokensRequest(MessagesRequest):
    """A POST /v1/messages/count_tokens body: a messages body, with no need of max_tokens."""

    max_tokens: int = Field(1, ge=1)


def _content(content: str | list[TextBlock]) -> str | list[dict[str, str]]:
    """Return content as the engine takes it: a string, or text parts (joined with "\\n", as vLLM joins them)."""
    if isinstance(content, str):
        return content
    return [{"type": "text", "text": block.text} for block in content]


def message_id() -> str:
    """Return a new message id, in Anthropic's form."""
    return f"msg_{uuid.uuid4().hex[:24]}"


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    """Return Anthropic's stop_reason for the engine's finish reason."""
    return "stop_sequence" if stop_sequence is not None else _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def usage_body(usage: Usage) -> dict[str, Any]:
    """Return Anthropic's usage: prompt tokens read from the cache, computed now and stored at a breakpoint (by ttl),
    and the rest."""
    written = {ttl: usage.cache_writes.get(seconds, 0) for ttl, seconds in TTL_SECONDS.items()}
    created = sum(written.values())
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - created,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": written["5m"], "ephemeral_1h_input_tokens": written["1h"]},
        "output_tokens": usage.completion_tokens,
    }


def message(
    message_id: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    stop_sequence: str | None,
    usage: Usage,
) -> dict[str, Any]:
    """Return a message body: the whole answer, or (with `text` None) the empty one a stream starts with."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}] if text else [],
        "stop_reason": None if text is None else stop_reason(finish_reason, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    """Return Anthropic's error object for a status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
