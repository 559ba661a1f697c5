"""What the admin routes accept: their bodies and query parameters, parsed and checked, with errors that say what to
send instead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from prefixgate.errors import RequestError
from prefixgate.proxy.body import parsed, parsed_object
from prefixgate.proxy.openai import api
from prefixgate.store import BlockKey

MAX_LIMIT = 1000
_Body = TypeVar("_Body", bound=BaseModel)
_Chat = TypeVar("_Chat", bound=api.ChatCompletionRequest)
_Text = TypeVar("_Text", bound=api.CompletionRequest)


class FlushRequest(BaseModel):
    """A POST /admin/cache/flush body: everything, one tier, or one tenant."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tier: str | None = None
    tenant: str | None = None


class _Acting(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tenant: str | None = None  # whom the warm or explain acts for


class _Keeping(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    pinned: bool = False
    ttl: float | None = Field(None, gt=0)  # seconds from now


class ChatExplainRequest(api.ChatCompletionRequest, _Acting):
    """A POST /admin/cache/explain body with `messages`: a chat completion request, and the tenant."""


class TextExplainRequest(api.CompletionRequest, _Acting):
    """A POST /admin/cache/explain body with `prompt`: a text completion request, and the tenant."""


class ChatWarmRequest(ChatExplainRequest, _Keeping):
    """A POST /admin/cache/warm body with `messages`: what to precompute, for whom, and how to keep its blocks."""


class TextWarmRequest(TextExplainRequest, _Keeping):
    """A POST /admin/cache/warm body with `prompt`: what to precompute, for whom, and how to keep its blocks."""


ExplainRequest = ChatExplainRequest | TextExplainRequest  # a warm body is one too


async def parse_body(request: web.Request, model: type[_Body]) -> _Body:
    """Return the JSON body validated as `model`; an empty body is an empty object."""
    raw = await request.read()
    return await parsed(raw if raw.strip() else b"{}", model)  # a flush of everything needs no body


async def parse_prompt_body(request: web.Request, chat: type[_Chat], text: type[_Text]) -> _Chat | _Text:
    """Return a warm or explain body: a text completion request when it has a `prompt`, else a chat request."""
    data = await parsed_object(await request.read())
    return (text if "prompt" in data else chat).model_validate(data)


def query(request: web.Request, *known: str) -> dict[str, str]:
    """Return the query parameters, refusing unknown ones: a misspelt filter must not silently list everything."""
    unknown = sorted(set(request.query) - set(known))
    if unknown:
        accepted = ", ".join(known) if known else "none"
        raise RequestError(f"unknown query parameter {unknown[0]!r}; this route accepts: {accepted}", param=unknown[0])
    return {name: request.query[name] for name in known if name in request.query}


def integer(params: dict[str, str], name: str, default: int, low: int, high: int | None = None) -> int:
    """Return an integer parameter within [low, high], or `default` when it is absent."""
    text = params.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise RequestError(f"{name} must be an integer, got {text!r}", param=name) from None
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise RequestError(f"{name} must be {bounds}, got {value}", param=name)
    return value


def boolean(params: dict[str, str], name: str) -> bool:
    """Return a true/false parameter; absent is false."""
    text = params.get(name, "false").lower()
    if text not in ("true", "false", "1", "0"):
        raise RequestError(f"{name} must be true or false, got {params[name]!r}", param=name)
    return text in ("true", "1")


def tier_name(name: str | None, names: Sequence[str]) -> str | None:
    """Return a tier name the store has, or None for every tier."""
    if name is not None and name not in names:
        raise RequestError(f"unknown tier {name!r}; this store has: {', '.join(names)}", param="tier")
    return name


def block_key(text: str) -> BlockKey:
    """Return the block key written as 32 hex digits."""
    try:
        return BlockKey.from_hex(text)
    except ValueError:
        raise RequestError(f"malformed entry key {text!r}: a key is 32 hex digits", param="key") from None


def acting_tenant(name: str | None, tenants: Sequence[str]) -> str:
    """Return the tenant a warm or explain acts for: one the API keys map to, or the anonymous one without keys."""
    if name is None and tenants:
        raise RequestError(f"name the tenant to act for: one of {', '.join(map(repr, tenants))}", param="tenant")
    if name is not None and name not in (tenants or [""]):
        known = f"one of {', '.join(map(repr, tenants))}" if tenants else "'' (no API keys are set), or leave it out"
        raise RequestError(f"unknown tenant {name!r}: send {known}", param="tenant")
    return name or ""
