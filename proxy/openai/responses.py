"""OpenAI's Responses API: its request shapes (validated with pydantic), their translation to a chat completion
request (which the engine takes), and the response and stream events we send back, as OpenAI's clients read them.

Stateless, as vLLM serves it by default: nothing is stored, so a request carries its whole conversation in `input`
(its earlier answers' items as they came back), and `previous_response_id` is refused with a 400 that says so.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from prefixgate.backends import TokenChunk, TokenLogprob
from prefixgate.errors import RequestError
from prefixgate.proxy.answer import Answer
from prefixgate.proxy.engine import PromptRequest, Usage
from prefixgate.proxy.openai.api import ChatCompletionRequest, Strict, logprob_entries

LOGPROBS = "message.output_text.logprobs"  # what `include` names to have the message's tokens' log probabilities


class _Item(Strict):
    """An input item. The `openai` client's dump of an earlier answer's items carries fields this server does not know
    as null; null is taken as not sent, so the items go back as they came."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_unsent(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: field for key, field in value.items() if field is not None or key in cls.model_fields}
        return value


class InputText(_Item):
    """A text part of an input message (`output_text`: an earlier answer's text, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier answer's, sent back as it came
    logprobs: list[Any] | None = None


class Message(_Item):
    """A message item: a role and its content, a string or text parts."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None  # an earlier answer's item, sent back as it came
    status: str | None = None


class FunctionCall(_Item):
    """A tool call of an earlier answer, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutput(_Item):
    """What a tool call returned."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Item):
    """A reasoning item's text."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class Reasoning(_Item):
    """An earlier answer's reasoning, sent back: its text goes to the next assistant turn's `reasoning_content`."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None  # another server's, which nothing here can read
    status: str | None = None


def _item_type(value: Any) -> str | None:
    """Return an input item's type, which says how it reads (a message may leave it out)."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if isinstance(kind, str) else None
    return getattr(value, "type", None)


Item = Annotated[
    Annotated[Message, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[Reasoning, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(Strict):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    """A tool_choice that names the function to call."""

    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """`text.format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(Strict):
    """The `text` field: the answer's format."""

    format: TextFormat | None = None


class ResponsesRequest(Strict):
    """A POST /v1/responses body."""

    model: str
    input: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[Item], Tag("items")],
        Discriminator(lambda value: "text" if isinstance(value, str) else "items"),
    ]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # alternatives to each token, where `include` asks for LOGPROBS
    stream: bool = False
    text: TextOptions | None = None
    store: bool | None = None  # accepted: nothing is stored here either way
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None  # the only kind here: a prompt past the context is a 400
    # What else to include: the message's log probabilities; an encrypted copy of the reasoning, which a local model's
    # has none of (a server in front of OpenAI's would). Nothing else is taken.
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    cache_salt: str | None = None  # prefixgate's, as on the other routes
    layout: bool | None = None

    def to_chat(self) -> ChatCompletionRequest:
        """Return the same request as a chat completion: `instructions` as the system message, then the items as
        messages (an answer's function calls as its tool calls, their outputs as tool messages, its reasoning as
        its `reasoning_content`)."""
        if self.previous_response_id is not None:
            raise RequestError(
                "this server stores no responses; send the whole conversation in input (the items of earlier "
                "answers as they came back) and leave previous_response_id out",
                param="previous_response_id",
            )
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": False}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        form = self.text.format if self.text is not None else None
        if form is not None and form.type == "json_schema":
            schema = {"name": form.name or "answer", "schema": form.schema_ or {}, "strict": form.strict}
            if form.description is not None:
                schema["description"] = form.description
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif form is not None:
            body["response_format"] = {"type": form.type}
        if self.include is not None and LOGPROBS in self.include:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        fields = {
            "parallel_tool_calls": self.parallel_tool_calls,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "metadata": self.metadata,
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "service_tier": self.service_tier,
            "cache_salt": self.cache_salt,
            "layout": self.layout,
        }
        body |= {name: value for name, value in fields.items() if value is not None}
        return ChatCompletionRequest.model_validate(body)

    def to_prompt_request(self, tenant: str) -> PromptRequest:
        """Return the engine's request."""
        return self.to_chat().to_prompt_request(tenant)

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        reasoning: list[str] = []  # an answer's reasoning, for the assistant turn that follows it
        for item in self.input:
            if isinstance(item, Reasoning):
                reasoning += [part.text for part in item.content or item.summary]
                continue
            if isinstance(item, FunctionCallOutput):
                output = item.output if isinstance(item.output, str) else "\n".join(p.text for p in item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
                continue
            if isinstance(item, FunctionCall):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not reasoning:
                    last.setdefault("tool_calls", []).append(call)  # the answer's calls follow its text
                    continue
                turn: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
            else:
                content = (
                    item.content
                    if isinstance(item.content, str)
                    else [{"type": "text", "text": part.text} for part in item.content]
                )
                turn = {"role": item.role, "content": content}
            if reasoning and turn["role"] == "assistant":
                turn["reasoning_content"], reasoning = "\n".join(reasoning), []
            messages.append(turn)
        return messages


def response_id() -> str:
    """Return a new response id, in OpenAI's form."""
    return f"resp_{uuid.uuid4().hex[:24]}"


def item_id(kind: str) -> str:
    """Return a new output item id (`msg`, `fc`, `rs`)."""
    return f"{kind}_{uuid.uuid4().hex[:24]}"


def response(
    body: ResponsesRequest,
    rid: str,
    created: float,
    items: list[dict[str, Any]],
    finish_reason: str | None,
    usage: Usage | None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """Return a response object: `in_progress` while `usage` is None (the one a stream starts with), else completed,
    or incomplete when the answer ran out of tokens; `reasoning_tokens`: the answer's tokens that carried reasoning."""
    status = "in_progress" if usage is None else "incomplete" if finish_reason == "length" else "completed"
    form = body.text.format if body.text is not None else None
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": body.model,
        "output": items,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": body.temperature,
        "text": {"format": form.model_dump(by_alias=True, exclude_none=True) if form else {"type": "text"}},
        "tool_choice": choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "top_p": body.top_p,
        "top_logprobs": body.top_logprobs,
        "truncation": "disabled",
        "usage": None if usage is None else usage_body(usage, reasoning_tokens),
        "metadata": body.metadata or {},
    }


def output_items(answer: Answer, logprobs: Sequence[TokenLogprob] = ()) -> list[dict[str, Any]]:
    """Return an answer's output items: its reasoning, its text as a message (with `logprobs`, its tokens' log
    probabilities), then each tool call (as a stream sends them, when its text does not come between its calls)."""
    items: list[dict[str, Any]] = []
    if answer.reasoning:
        items.append(reasoning_item(item_id("rs"), answer.reasoning))
    if answer.text or (not items and not answer.tool_calls):  # an answer of nothing is an empty message
        items.append(message_item(item_id("msg"), answer.text, "completed", logprobs))
    items += [call_item(item_id("fc"), call.id, call.name, call.arguments, "completed") for call in answer.tool_calls]
    return items


def reasoning_item(item: str, text: str) -> dict[str, Any]:
    """Return a reasoning item (its text as `reasoning_text` content, as open models' servers send it)."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item, "summary": [], "content": content}


def message_item(item: str, text: str | None, status: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """Return an assistant message item; `text` None: one just begun, with no content part yet."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"type": "message", "id": item, "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """Return an output_text content part, with its tokens' log probabilities."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprob_entries(logprobs)}


def message_logprobs(chunks: Iterable[TokenChunk]) -> list[TokenLogprob]:
    """Return the log probabilities of the tokens that went to the message: not those of the chunks that carried
    reasoning or tool calls (each chunk carries its token's, whatever text it releases)."""
    return [entry for chunk in chunks if not chunk.reasoning and not chunk.tool_calls for entry in chunk.logprobs]


def call_item(item: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """Return a function_call item."""
    return {
        "type": "function_call",
        "id": item,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    """Return the Responses API's usage object, with the cached input tokens."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
