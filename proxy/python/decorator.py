"""Decorated functions: a function returns chat messages or a prompt string; calling it returns the model's Reply.

`PromptCache.cached` makes them. Generation options are fixed at decoration and overridden per call with
`fn.with_options(...)`, a method rather than extra keyword arguments so they never collide with the function's own
parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Self, Unpack

from pydantic import ConfigDict, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic reads its annotations on Python 3.11

from prefixgate.backends import SamplingParams
from prefixgate.errors import RequestError
from prefixgate.proxy.engine import PromptRequest
from prefixgate.proxy.openai.api import DEFAULT_MAX_TOKENS, Message
from prefixgate.proxy.python.reply import AsyncReplyStream, Reply, ReplyStream

if TYPE_CHECKING:
    from prefixgate.proxy.python.prompt_cache import PromptCache

P = ParamSpec("P")

Prompt = str | Sequence[Mapping[str, Any]]
"""What a decorated function returns: chat messages (`[{"role": ..., "content": ...}, ...]`) or a prompt string."""


@with_config(ConfigDict(strict=True))  # `max_tokens="2"` or `True` is a mistake to report, not a value to convert
class Options(TypedDict, total=False):
    """Generation options of a decorated function; each one left out keeps its current value."""

    max_tokens: int  # default 512, as the HTTP API's
    temperature: float  # default 1.0; 0 is greedy
    top_p: float
    top_k: int  # 0 is off
    seed: int | None
    stop: str | Sequence[str]
    cache_salt: str | None  # splits the cache: prefixes are shared only between calls with the same salt
    layout: bool  # default True: move dates, times and ids out of system prompts (static before dynamic)


class CachedFunction(Generic[P]):
    """A function whose returned prompt the model answers: calling it returns a Reply."""

    __name__: str  # copied from the function, with its docstring and module
    __wrapped__: Callable[P, Prompt]

    def __init__(self, cache: PromptCache, function: Callable[P, Prompt], options: GenerationOptions) -> None:
        functools.update_wrapper(self, function)
        self._cache = cache
        self._function = function
        self.options = options

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Reply:
        return self._cache.reply(self.options.request(self._function, self._function(*args, **kwargs)))

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> ReplyStream:
        """Return an iterator over the reply's text as it is generated; its `reply` is the whole result at the end."""
        return self._cache.stream(self.options.request(self._function, self._function(*args, **kwargs)))

    def with_options(self, **options: Unpack[Options]) -> Self:
        """Return this function with some options changed, e.g. `ask.with_options(max_tokens=50)("q")`."""
        return type(self)(self._cache, self._function, self.options.merged(options))

    def __repr__(self) -> str:
        return f"<cached function {self._function.__qualname__} {self.options}>"


class AsyncCachedFunction(Generic[P]):
    """An `async def` function whose returned prompt the model answers: awaiting a call returns a Reply."""

    __name__: str
    __wrapped__: Callable[P, Awaitable[Prompt]]

    def __init__(
        self, cache: PromptCache, function: Callable[P, Awaitable[Prompt]], options: GenerationOptions
    ) -> None:
        functools.update_wrapper(self, function)
        self._cache = cache
        self._function = function
        self.options = options

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Reply:
        prompt = await self._function(*args, **kwargs)
        return await self._cache.areply(self.options.request(self._function, prompt))

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> AsyncReplyStream:
        """Return an async iterator over the reply's text; the function runs when iteration starts."""

        async def build() -> PromptRequest:
            return self.options.request(self._function, await self._function(*args, **kwargs))

        return self._cache.astream(build)

    def with_options(self, **options: Unpack[Options]) -> Self:
        """Return this function with some options changed, e.g. `await ask.with_options(max_tokens=50)("q")`."""
        return type(self)(self._cache, self._function, self.options.merged(options))

    def __repr__(self) -> str:
        return f"<cached async function {self._function.__qualname__} {self.options}>"


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """The checked options of a decorated function, and how they turn its prompt into the engine's request."""

    params: SamplingParams
    cache_salt: str | None = None
    layout: bool = True

    def merged(self, options: Options) -> GenerationOptions:
        """Return these options with some changed, checking names and values now rather than at the first call."""
        unknown = sorted(set(options) - set(Options.__annotations__))
        if unknown:
            raise TypeError(
                f"unknown option {', '.join(map(repr, unknown))}; the options are: {', '.join(Options.__annotations__)}"
            )
        try:
            _OPTIONS.validate_python(options)
        except ValidationError as error:
            problem = error.errors()[0]
            name = str(problem["loc"][0])
            raise TypeError(f"option {name}={options[name]!r}: {problem['msg']}") from None  # type: ignore[literal-required]
        changes: dict[str, Any] = dict(options)
        if isinstance(changes.get("stop"), str):
            changes["stop"] = (changes["stop"],)
        elif "stop" in changes:
            changes["stop"] = tuple(changes["stop"] or ())
        sampling = {name: changes.pop(name) for name in _SAMPLING_FIELDS if name in changes}
        merged = replace(self, params=replace(self.params, **sampling), **changes)  # SamplingParams checks values
        if merged.cache_salt is not None and not 1 <= len(merged.cache_salt) <= 256:
            raise RequestError("cache_salt must be 1 to 256 characters, or None", param="cache_salt")
        return merged

    def request(self, function: Callable[..., Any], prompt: object) -> PromptRequest:
        """Return the engine's request for what `function` returned, or say what it should return instead."""
        name = getattr(function, "__qualname__", repr(function))
        common = {"params": self.params, "cache_salt": self.cache_salt, "layout": self.layout}
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(f"{name}() returned an empty prompt; return some text", param="prompt")
            return PromptRequest(prompt=prompt, **common)  # type: ignore[arg-type]
        if not isinstance(prompt, Sequence) or not all(isinstance(message, Mapping) for message in prompt):
            raise TypeError(
                f"{name}() returned {type(prompt).__name__}; return chat messages, a list like "
                "[{'role': 'user', 'content': '...'}], or a prompt string"
            )
        try:
            # The HTTP API's own message model: the same prompt is accepted or refused in process and on a server.
            messages = _MESSAGES.validate_python(list(prompt))
        except ValidationError as error:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in problem['loc']) or 'messages'}: {problem['msg']}"
                for problem in error.errors()
            )
            raise RequestError(
                f"{name}() returned messages the chat API refuses: {problems}", param="messages"
            ) from None
        if not messages:
            raise RequestError(f"{name}() returned no messages; return at least one", param="messages")
        dumped = [message.model_dump(exclude_none=True) for message in messages]
        return PromptRequest(messages=dumped, **common)  # type: ignore[arg-type]


def resolve_options(**options: Unpack[Options]) -> GenerationOptions:
    """Return checked options: the HTTP API's defaults, with `options` applied."""
    return _DEFAULTS.merged(options)


_SAMPLING_FIELDS = frozenset(field.name for field in fields(SamplingParams))
_DEFAULTS = GenerationOptions(SamplingParams(max_tokens=DEFAULT_MAX_TOKENS))
_MESSAGES = TypeAdapter(list[Message])
_OPTIONS = TypeAdapter(Options)
