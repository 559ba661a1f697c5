"""Explain a request's cache misses: what of its prompt is cached in which tier, and where and why the rest departs.

The cached prefix runs through whole blocks and then the leading tokens of the nearest cached block that continues
the same chain (found by the store's lookup, under the last block that hit), so the token where the prompt departs is
where that block's tokens and the prompt's first differ. That token is mapped back to a message and a character by
decoding the token prefix and finding each message's content in the decoded prompt (`_PromptText`), which works for
any tokenizer and chat template that keeps message contents verbatim. A dynamic value (a timestamp, a date, a UUID)
found where the prompt departs is named as the likely cause.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from prefixgate.backends import Backend
from prefixgate.backends.router import BLOCK_CHARS, Route, Upstream
from prefixgate.proxy.layout import STATIC_ROLES, DynamicMatch, DynamicPattern, MovedValue, find_dynamic
from prefixgate.store import Block, BlockKey, PrefixMatch, TieredStore, chain_keys, shared_prefix

if TYPE_CHECKING:
    from prefixgate.proxy.engine import PreparedPrompt
    from prefixgate.proxy.upstream_engine import Forward

# What a value found by each default pattern is called in an explanation.
_WORDS = {"datetime": "timestamp", "date": "date", "time": "time", "uuid": "UUID", "request_id": "request id"}
_SNIPPET_TOKENS = 12


@dataclass(frozen=True, slots=True)
class Departure:
    """Where a prompt first departs from the nearest cached prefix, and the likely cause."""

    token: int  # the first prompt token no cached block continues with
    block: int  # the first block that misses
    message: int | None  # index into the messages as rendered (canonical, laid out); None past the last one
    role: str | None
    character: int | None  # offset in that message's rendered content; None in the template's own text before it
    nearest: BlockKey | None  # the cached block compared with; None when nothing continues the cached prefix
    prompt_text: str  # this prompt's text from the departure on (a snippet)
    cached_text: str | None  # the nearest cached block's text from the departure on
    dynamic: DynamicMatch | None  # a per-request value at the departure, in the message's content
    cause: str


@dataclass(frozen=True, slots=True)
class Explanation:
    """A dry run of one request against the cache: nothing is loaded, moved or counted."""

    tenant: str
    prompt_tokens: int
    reusable_tokens: int  # the most the cache could serve: every token before the last, once a block precedes it
    cached_tokens: int
    tokens_by_tier: dict[str, int]
    messages: list[dict[str, Any]] | None  # as rendered: canonical and laid out
    canonicalized: tuple[int, ...]  # indices of the messages canonicalization changed
    layout: bool  # whether layout ran for this request
    moved: tuple[MovedValue, ...]
    departure: Departure | None  # None on a full hit, or when nothing can be cached
    summary: str


@dataclass(frozen=True, slots=True)
class RouteExplanation:
    """A dry run of one request in front of upstreams: where it would go now, and why. Nothing is sent or recorded."""

    tenant: str
    messages: list[dict[str, Any]] | None  # as they would be sent: canonical and laid out
    layout: bool
    moved: tuple[MovedValue, ...]
    characters: int  # of the prompt's text, as the router cuts it into keys
    hint: str | None  # the request's prompt_cache_key, or else its user
    route: Route | None  # None while no upstream may take a request
    matched: dict[Upstream, int]  # leading keys of the prompt each upstream was sent before
    summary: str


def explain_route(
    forward: Forward, hint: str | None, route: Route | LookupError, matched: dict[Upstream, int], threshold: float
) -> RouteExplanation:
    """Return the explanation of where the router sends a request (or why it can send it nowhere now)."""
    characters = forward.characters
    explanation = partial(
        RouteExplanation,
        forward.tenant,
        forward.body.get("messages"),
        forward.layout,
        forward.moved,
        characters,
        hint,
        matched=matched,
    )
    if isinstance(route, LookupError):
        return explanation(route=None, summary=str(route))
    if route.reason == "prefix":
        held = _characters(route.matched, characters)
        why = f"it was sent the first {held} of the prompt's {characters} characters before, so it likely holds them"
    elif route.reason == "load":
        assert route.displaced is not None
        busy, here = route.displaced.in_flight, route.upstream.in_flight
        why = f"{route.displaced.url} comes first for the prompt, but has {busy} requests in flight against {here} here"
    else:
        how = (
            "the request's prompt_cache_key (or user) picks it, as it does for every request that shares it"
            if route.reason == "hint"
            else "it took a new prompt longest ago, so new prompts spread"
        )
        why = f"no upstream was sent {threshold:.0%} or more of the prompt before, and {how}"
    return explanation(route=route, summary=f"{route.upstream.url} would take it: {why}")


def route_explanation_body(explanation: RouteExplanation) -> dict[str, Any]:
    """Return a route explanation as JSON."""
    route = explanation.route
    characters = explanation.characters
    return {
        "object": "route.explanation",
        "tenant": explanation.tenant,
        "messages": explanation.messages,
        "layout": _layout_body(explanation.layout, explanation.moved),
        "prompt_characters": characters,
        "hint": explanation.hint,
        "route": None
        if route is None
        else {
            "upstream": route.upstream.url,
            "reason": route.reason,
            "matched_characters": _characters(route.matched, characters),
            "displaced": route.displaced.url if route.displaced is not None else None,
        },
        "upstreams": [
            {
                "url": upstream.url,
                "available": upstream.failures == 0,
                "in_flight": upstream.in_flight,
                "matched_characters": _characters(keys, characters),
            }
            for upstream, keys in explanation.matched.items()
        ],
        "summary": explanation.summary,
    }


def _characters(keys: int, characters: int) -> int:
    return min(keys * BLOCK_CHARS, characters)


def explain_prompt(
    store: TieredStore,
    backend: Backend,
    prepared: PreparedPrompt,
    original: Sequence[Mapping[str, Any]] | None,
    canonical: Sequence[Mapping[str, Any]] | None,
    patterns: Sequence[DynamicPattern],
    layout: bool,
) -> Explanation:
    """Explain a prepared prompt against the store; blocking: call it in a worker thread."""
    size = store.layout.block_size
    match = store.lookup(prepared.namespace, prepared.token_ids)
    reuse = backend.prefix_reuse
    by_tier = {tier.name: 0 for tier in store.tiers} | (match.tokens_by_tier if reuse else {})
    cached = match.cached_tokens if reuse else 0
    # A partial block is found under the block before it, so the first block is reused whole or not at all.
    reusable = len(prepared.token_ids) - 1 if len(prepared.token_ids) > size else 0
    departure = None
    if reuse and cached < reusable:
        departure = _departure(store, backend, prepared, match, patterns, layout)
    changed = tuple(
        index
        for index, (before, after) in enumerate(zip(original or (), canonical or (), strict=True))
        if before != after
    )
    summary = _summary(backend, len(prepared.token_ids), reusable, cached, size, departure)
    return Explanation(
        tenant=prepared.tenant,
        prompt_tokens=len(prepared.token_ids),
        reusable_tokens=reusable,
        cached_tokens=cached,
        tokens_by_tier=by_tier,
        messages=prepared.messages,
        canonicalized=changed,
        layout=layout,
        moved=prepared.moved,
        departure=departure,
        summary=summary,
    )


def explanation_body(explanation: Explanation) -> dict[str, Any]:
    """Return an explanation as JSON."""
    departure = explanation.departure
    return {
        "object": "cache.explanation",
        "tenant": explanation.tenant,
        "prompt_tokens": explanation.prompt_tokens,
        "reusable_tokens": explanation.reusable_tokens,
        "cached_tokens": explanation.cached_tokens,
        "cached_tokens_by_tier": explanation.tokens_by_tier,
        "messages": explanation.messages,
        "canonicalized": list(explanation.canonicalized),
        "layout": _layout_body(explanation.layout, explanation.moved),
        "departure": None
        if departure is None
        else {
            "token": departure.token,
            "block": departure.block,
            "message": departure.message,
            "role": departure.role,
            "character": departure.character,
            "nearest": departure.nearest.hex() if departure.nearest is not None else None,
            "prompt_text": departure.prompt_text,
            "cached_text": departure.cached_text,
            "dynamic": None
            if departure.dynamic is None
            else {
                "pattern": departure.dynamic.pattern,
                "value": departure.dynamic.value,
                "start": departure.dynamic.start,
                "end": departure.dynamic.end,
            },
            "cause": departure.cause,
        },
        "summary": explanation.summary,
    }


def _departure(
    store: TieredStore,
    backend: Backend,
    prepared: PreparedPrompt,
    match: PrefixMatch,
    patterns: Sequence[DynamicPattern],
    layout: bool,
) -> Departure:
    size = store.layout.block_size
    tokens = prepared.token_ids
    block = len(match.tiers)
    nearest: tuple[BlockKey, tuple[int, ...]] | None = None
    common = 0
    if match.partial is not None:  # the block continuing the prefix that shares the most tokens, as the lookup found it
        nearest, common = (match.partial.key, match.partial.block_tokens), match.partial.tokens
    elif block == 0:
        found, common = _nearest_first_block(store, prepared)
        nearest = (found.key, found.tokens) if found is not None else None
    token = block * size + common
    text = _PromptText(backend, tokens, prepared.messages)
    start = text.offset(token)
    message, character = text.locate(start)
    role = text.role(message)
    dynamic = None
    if nearest is not None and message is not None and character is not None:
        # The departing token's own span; a value that overlaps it is what made the prompts differ.
        width = text.offset(token + 1) - start
        dynamic = _dynamic_at(text.content(message), character, character + width, patterns)
    cached_text = backend.decode(nearest[1][common:]) if nearest is not None else None
    prompt_text = backend.decode(tokens[token : token + _SNIPPET_TOKENS])
    departure = Departure(
        token, block, message, role, character, nearest[0] if nearest else None, prompt_text, cached_text, dynamic, ""
    )
    return replace(departure, cause=_cause(departure, layout, len(text.spans), prepared.moved))


def _nearest_first_block(store: TieredStore, prepared: PreparedPrompt) -> tuple[Block | None, int]:
    """Return the cached first block of this namespace that shares most tokens with the prompt's first block.

    A first block has no parent to index it under, so this reads the tenant's entries: a dry run's cost, never a
    request's.
    """
    size = store.layout.block_size
    wanted = prepared.token_ids[:size]
    seed = store.seed(prepared.namespace)
    best: Block | None = None
    best_common = 0
    seen: set[BlockKey] = set()
    for entry in store.entries(tenant=prepared.tenant):
        if entry.parent is not None or entry.key in seen:
            continue
        seen.add(entry.key)
        candidate = store.read(entry.key)
        # A first block has no parent to tie it to this namespace (model, tenant, salt); its key does.
        if candidate is None or chain_keys(seed, candidate.tokens, size)[:1] != [entry.key]:
            continue
        common = shared_prefix(candidate.tokens, wanted)
        if best is None or common > best_common:
            best, best_common = candidate, common
    return best, best_common


class _PromptText:
    """The prompt decoded to text, with where each message's content lies in it."""

    def __init__(self, backend: Backend, tokens: Sequence[int], messages: list[dict[str, Any]] | None) -> None:
        self._backend = backend
        self._tokens = tokens
        self.text = backend.decode(tokens)
        # A completion prompt is one piece of content: the whole text.
        self.messages = messages if messages is not None else [{"role": None, "content": self.text}]
        self.spans = _content_spans(self.text, self.messages)

    def offset(self, token: int) -> int:
        """Return the character offset in the decoded prompt where token `token` starts."""
        # Decoding the token prefix is simpler than tracking offsets through the tokenizer, and right for any of
        # them: where a token ends inside a character (byte-level BPE), the common prefix stops before it.
        prefix = self._backend.decode(self._tokens[:token])
        return shared_prefix(prefix, self.text)

    def locate(self, offset: int) -> tuple[int | None, int | None]:
        """Return the message and the character in its content at `offset`; no character in template text."""
        for index, span in enumerate(self.spans):
            if span is not None and span[0] <= offset <= span[1]:
                return index, offset - span[0] + span[2]
        following = [index for index, span in enumerate(self.spans) if span is not None and span[0] > offset]
        return (following[0] if following else None), None

    def role(self, message: int | None) -> str | None:
        """Return the role of a message, if there is one."""
        return None if message is None else self.messages[message].get("role")

    def content(self, message: int) -> str:
        """Return a message's content as rendered, or "" when it has no text."""
        content = self.messages[message].get("content")
        return content if isinstance(content, str) else ""


def _content_spans(text: str, messages: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, int] | None]:
    """Find each message's content in the decoded prompt, in order: (start, end, characters the template trimmed)."""
    spans: list[tuple[int, int, int] | None] = []
    cursor = 0
    for message in messages:
        content = message.get("content")
        span = None
        if isinstance(content, str) and content:
            found, trimmed = text.find(content, cursor), 0
            if found < 0 and content.strip():  # a template that trims contents
                trimmed = len(content) - len(content.lstrip())
                content = content.strip()
                found = text.find(content, cursor)
            if found >= 0:
                span = (found, found + len(content), trimmed)
                cursor = span[1]
        spans.append(span)
    return spans


def _dynamic_at(content: str, start: int, end: int, patterns: Sequence[DynamicPattern]) -> DynamicMatch | None:
    """Return the per-request value overlapping characters [start, end] of a message's content, if any."""
    for match in find_dynamic(content, patterns):
        if match.start <= end and match.end > start:
            return match
    return None


def _cause(departure: Departure, layout: bool, messages: int, moved: Sequence[MovedValue]) -> str:
    """Return the likely cause of a departure, in words."""
    where = _where(departure.message, departure.role)
    dynamic = departure.dynamic
    if departure.nearest is None:
        if departure.token == 0:
            return (
                "nothing cached in this namespace (model, tenant and cache_salt) starts like this prompt: no earlier "
                "request began with the same tokens, or their blocks were evicted, expired or deleted"
            )
        return (
            f"nothing was ever cached beyond token {departure.token} of this prefix: no earlier request with the "
            f"same first {departure.token} tokens went further, or its later blocks were evicted, expired or deleted"
        )
    if dynamic is not None:
        word = _WORDS.get(dynamic.pattern, dynamic.pattern.replace("_", " "))
        cause = (
            f"{where} contains a {word} {dynamic.value!r} at character {dynamic.start} that changes between requests"
        )
        if departure.role not in STATIC_ROLES and any(value.value == dynamic.value for value in moved):
            return cause + (
                ": layout moved it there from a system or developer message, so that everything before it is served "
                "from the cache; this miss is the expected one"
            )
        if departure.role not in STATIC_ROLES:
            return cause + "; layout moves such values only out of system and developer messages: put them last"
        if not layout:
            return cause + (
                '; layout is off for this request ("layout": false, or the server runs with --no-layout), so the '
                'value stays inside the static prefix: turn layout on ("layout": true) or move the value to the end '
                "of the prompt"
            )
        return cause
    difference = f"the cache has {departure.cached_text!r} where this prompt has {departure.prompt_text!r}"
    if departure.character is None:
        place = f"before {where}" if departure.message is not None else "after the last message"
        return (
            f"the prompt departs in the chat template's own text {place} (roles, names, tool calls or tool "
            f"definitions differ): {difference}"
        )
    cause = f"{where} differs from the nearest cached prompt at character {departure.character}: {difference}"
    if departure.message == messages - 1 and departure.role not in STATIC_ROLES:
        cause += "; this is the request's last message, where a new question is expected to begin"
    return cause


def _where(message: int | None, role: str | None) -> str:
    if message is None:
        return "the prompt"
    if role in STATIC_ROLES:
        return f"the {role} prompt" if message == 0 else f"the {role} message {message}"
    return f"message {message} ({role})" if role else "the prompt"


def _layout_body(enabled: bool, moved: Sequence[MovedValue]) -> dict[str, Any]:
    return {
        "enabled": enabled,
        "moved": [
            {"pattern": value.pattern, "value": value.value, "message": value.message, "character": value.start}
            for value in moved
        ],
    }


def _summary(backend: Backend, prompt: int, reusable: int, cached: int, size: int, departure: Departure | None) -> str:
    if not backend.prefix_reuse:
        return f"this model cannot reuse KV blocks ({backend.reuse_refusal}); every request computes its whole prompt"
    if reusable == 0:
        return (
            f"the prompt has {prompt} tokens, not more than one block ({size} tokens): the last token is always "
            "computed, so nothing of it can be served from the cache"
        )
    head = f"{cached} of {prompt} prompt tokens would be served from the cache"
    if departure is None:
        return f"{head}: every token before the last"
    place = f"token {departure.token}"
    if departure.message is not None:
        place += f" (message {departure.message}"
        place += f", character {departure.character})" if departure.character is not None else ", template text)"
    return f"{head}; the prompt departs from the nearest cached prefix at {place}: {departure.cause}"
