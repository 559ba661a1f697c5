"""The Anthropic Messages API's request shapes (validated with pydantic), their translation to the engine's request,
and the bodies and stream events we send back, as Anthropic's clients expect them."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prefixgate.backends import SamplingParams
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import Answer
from prefixgate.proxy.engine import Breakpoint, PromptRequest, Usage
from prefixgate.proxy.openai.api import MAX_STOP_CHARACTERS, MAX_STOP_STRINGS, Strict

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
_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "tool_calls": "tool_use", "content_filter": "refusal"}
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


class ToolUseBlock(Strict):
    """A tool call the assistant made, in an earlier turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    """What a tool call returned, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(Strict):
    """The assistant's thinking in an earlier turn, sent back as it came (as Anthropic has tool loops do)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # this server signs nothing: it sends "" and checks nothing


class RedactedThinkingBlock(Strict):
    """Thinking another server encrypted: nothing a local model can read, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class MessageParam(Strict):
    """One message of the conversation."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        if value == []:
            raise ValueError("a message's content is an empty list; send at least one content block, or a string")
        for index, block in enumerate(value if isinstance(value, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in _BLOCK_TYPES:
                raise ValueError(
                    f"block {index} is of type {kind!r}: this server takes text, tool_use, tool_result, thinking and "
                    "redacted_thinking content blocks; send the content as text"
                )
        return value

    @model_validator(mode="after")
    def _thinking_is_the_assistants(self) -> MessageParam:
        if self.role != "assistant" and any(
            isinstance(block, ThinkingBlock | RedactedThinkingBlock)
            for block in (self.content if isinstance(self.content, list) else ())
        ):
            raise ValueError("a user message carries no thinking blocks; only the assistant's turns do")
        return self


class ToolChoice(Strict):
    """Which tool the model may or must call: any of them (auto), one of them (any), the one named (tool), or none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice {"type": "tool"} needs "name", the tool to call; no other type takes one')
        return self

    def openai(self) -> str | dict[str, Any]:
        """Return the same choice in OpenAI's form."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ToolParam(Strict):
    """A tool the model may call, in Anthropic's shape."""

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class Thinking(Strict):
    """Extended thinking, on with a budget of tokens or off: it reaches the chat template as `enable_thinking` (Qwen3's
    switch); a template without one renders as it always does."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1024)  # checked as Anthropic checks it; max_tokens bounds the answer

    def template_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Return the chat template's variables, refusing a budget Anthropic would refuse."""
        if self.type == "disabled":
            if self.budget_tokens is not None:
                raise RequestError("budget_tokens goes with thinking enabled; leave it out", param="thinking")
            return {"enable_thinking": False}
        if self.budget_tokens is None:
            raise RequestError("thinking enabled needs budget_tokens (at least 1024)", param="thinking.budget_tokens")
        if max_tokens and self.budget_tokens >= max_tokens:
            raise RequestError(
                f"thinking.budget_tokens must be less than max_tokens ({max_tokens}); lower it, or raise max_tokens",
                param="thinking.budget_tokens",
            )
        return {"enable_thinking": True}


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
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
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

    def _blocks(self) -> list[ToolParam | TextBlock | ToolUseBlock | ToolResultBlock]:
        """Return every block that may carry a breakpoint, in prompt order: tools, system, messages."""
        blocks: list[ToolParam | TextBlock | ToolUseBlock | ToolResultBlock] = list(self.tools or ())
        blocks += self.system if isinstance(self.system, list) else []
        for message in self.messages:
            content = message.content if isinstance(message.content, list) else []
            blocks += [block for block in content if isinstance(block, TextBlock | ToolUseBlock | ToolResultBlock)]
        return blocks

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request in OpenAI's shape: the system prompt first, text blocks as text parts,
        tool_use blocks as the assistant's tool calls and tool_result blocks as tool messages, the tools as function
        tools, with the cache breakpoints placed where their blocks land."""
        choice = self.tool_choice.openai() if self.tool_choice is not None else None
        if choice is not None and choice != "none" and not self.tools:
            raise RequestError("tool_choice needs tools; send tools or leave tool_choice out", param="tool_choice")
        with_tools = bool(self.tools) and choice != "none"
        points = [
            Breakpoint(tool.cache_control.seconds, tool=index)
            for index, tool in enumerate(self.tools or ())
            if tool.cache_control is not None and with_tools
        ]
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _content(self.system)})
            for part, block in enumerate(self.system if isinstance(self.system, list) else ()):
                if block.cache_control is not None:
                    points.append(Breakpoint(block.cache_control.seconds, message=0, part=part))
        for message in self.messages:
            points += _translate(message, messages)
        if self.cache_control is not None:  # on the last block that can take one: the whole prompt
            points.append(Breakpoint(self.cache_control.seconds))
        tools = [
            {
                "type": "function",
                "function": {"name": tool.name, "parameters": tool.input_schema}
                | ({"description": tool.description} if tool.description is not None else {}),
            }
            for tool in self.tools or ()
        ]
        params = SamplingParams(
            max_tokens=max(1, self.max_tokens),  # a pre-warm (0) generates nothing: the engine warms instead
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop_sequences or ()),
        )
        parallel = None
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use is not None:
            parallel = not self.tool_choice.disable_parallel_tool_use
        return PromptRequest(
            params=params,
            messages=messages,
            tools=tools or None,
            tenant=tenant,
            cache_salt=self.cache_salt,
            layout=self.layout,
            hint=self.metadata.user_id if self.metadata is not None else None,
            breakpoints=tuple(points),
            tool_choice=choice,
            parallel_tool_calls=parallel,
            template_kwargs=self.thinking.template_kwargs(self.max_tokens) if self.thinking is not None else {},
        )


def _translate(message: MessageParam, messages: list[dict[str, Any]]) -> list[Breakpoint]:
    """Append one Anthropic message to `messages` in OpenAI's shape; return the breakpoints its blocks carry, placed
    in `messages`.

    A user turn's tool results become tool messages, before the text it adds; an assistant turn's tool_use blocks
    become its tool calls, after its text.
    """
    if isinstance(message.content, str):
        messages.append({"role": message.role, "content": message.content})
        return []
    points: list[Breakpoint] = []
    texts = [block for block in message.content if isinstance(block, TextBlock)]
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            content = block.content if isinstance(block.content, str) else "\n".join(b.text for b in block.content)
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
            if block.cache_control is not None:
                points.append(Breakpoint(block.cache_control.seconds, message=len(messages) - 1))
    calls = [block for block in message.content if isinstance(block, ToolUseBlock)]
    if not texts and not calls:
        return points
    at = len(messages)
    turn: dict[str, Any] = {"role": message.role, "content": _content(texts) if texts else None}
    thinking = [block.thinking for block in message.content if isinstance(block, ThinkingBlock)]
    if thinking:
        turn["reasoning_content"] = "\n".join(thinking)  # as the OpenAI face takes it: for the chat template
    if calls:
        turn["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}
            for call in calls
        ]
    messages.append(turn)
    for part, block in enumerate(texts):
        if block.cache_control is not None:
            points.append(Breakpoint(block.cache_control.seconds, message=at, part=part))
    if any(call.cache_control is not None for call in calls):  # the tool calls end the message
        seconds = max(call.cache_control.seconds for call in calls if call.cache_control is not None)
        points.append(Breakpoint(seconds, message=at))
    return points


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
    message_id: str, model: str, answer: Answer | None, finish_reason: str | None, usage: Usage
) -> dict[str, Any]:
    """Return a message body: the whole answer, or (with `answer` None) the empty one a stream starts with."""
    stop = None if answer is None else answer.stop_sequence
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [] if answer is None else content_blocks(answer),
        "stop_reason": None if answer is None else stop_reason(finish_reason, stop),
        "stop_sequence": stop,
        "usage": usage_body(usage),
    }


def content_blocks(answer: Answer) -> list[dict[str, Any]]:
    """Return an answer's content blocks: its reasoning as thinking, its text, then each tool call as tool_use."""
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        blocks.append({"type": "text", "text": answer.text})
    blocks += [tool_use(call.id, call.name, call.arguments) for call in answer.tool_calls]
    return blocks


def tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """Return a tool_use block for a call whose arguments are JSON text (`{}` when empty)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    # Anthropic's input is an object; arguments that are not one (a model's broken JSON) are kept whole as text.
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": value if isinstance(value, dict) else {"arguments": arguments},
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    """Return Anthropic's error object for a status."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
