"""The engine: one object runs the whole pipeline for every face (HTTP, decorator, admin) and keeps the statistics.

validate → canonicalize → lay out → render → longest cached prefix → generate → store each new block
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from prefixgate.backends import (
    Backend,
    BlockCallback,
    KVReservation,
    PrefixStart,
    SamplingParams,
    TokenChunk,
    TokenLogprob,
)
from prefixgate.backends.backend import check_context, check_token_ids
from prefixgate.errors import OverloadedError, RequestError
from prefixgate.proxy.canonicalize import (
    DEFAULT_RULES,
    CanonicalRules,
    canonicalize_messages,
    canonicalize_text,
    canonicalize_tools,
)
from prefixgate.proxy.explain import Explanation, explain_prompt
from prefixgate.proxy.layout import DEFAULT_PATTERNS, DynamicPattern, MovedValue, lay_out
from prefixgate.proxy.prompt_size import check_prompt_size
from prefixgate.proxy.reasoning import ReasoningStream
from prefixgate.proxy.statistics import EngineStats
from prefixgate.proxy.tool_use import ToolCallStream, answer_grammar
from prefixgate.store import (
    Block,
    BlockKey,
    Borrowed,
    HeldRun,
    Namespace,
    PrefixHit,
    TieredStore,
    chain_keys,
    shared_prefix,
    tail_key,
)
from prefixgate.threads import torch_executor

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Keep a prefix of the prompt at least `seconds`: the whole prompt, or the part up to the end of one message (or
    one content part of it), or of one tool's definition."""

    seconds: float
    message: int | None = None  # an index into `PromptRequest.messages`
    part: int | None = None  # an index into that message's content parts; None: the whole message
    tool: int | None = None  # an index into `PromptRequest.tools`

    def cut(self, request: PromptRequest) -> PromptRequest | None:
        """Return the request with everything after the breakpoint left out; None when it keeps the whole prompt."""
        if self.tool is not None:
            return replace(request, tools=(request.tools or [])[: self.tool + 1], messages=[])
        if self.message is None or request.messages is None:
            return None
        messages = request.messages[: self.message + 1]
        content = messages[-1].get("content")
        if self.part is not None and isinstance(content, list):
            messages[-1] = messages[-1] | {"content": content[: self.part + 1]}
        return replace(request, messages=messages)


@dataclass(frozen=True, slots=True)
class Retained:
    """The first `tokens` of a prompt, to be kept at least `seconds`."""

    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class PromptRequest:
    """One request as the engine takes it, from any face: chat `messages` or a completion `prompt` (text, or token
    ids, which are neither canonicalized nor laid out)."""

    params: SamplingParams
    messages: list[dict[str, Any]] | None = None
    prompt: str | tuple[int, ...] | None = None
    tools: list[dict[str, Any]] | None = None
    tenant: str = ""  # who asks; decided by the server, never by the client
    cache_salt: str | None = None  # splits the tenant's cache further
    layout: bool = True
    hint: str | None = None  # the client's affinity hint (prompt_cache_key or user): upstreams are routed by it
    breakpoints: tuple[Breakpoint, ...] = ()  # prefixes the client asks to keep (cache_control, 24h retention)
    tool_choice: str | dict[str, Any] | None = None  # OpenAI's forms: "none", "auto", "required", a named function
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    extensions: dict[str, Any] = field(default_factory=dict)  # fields vLLM and SGLang take, passed on to upstreams
    # What the chat template is given besides the messages and tools (vLLM's chat_template_kwargs: Qwen3's
    # enable_thinking, say): it renders another prompt, so it is keyed apart by its tokens.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompt_tail: bool = False  # file the prompt's partial last block before the first token (for choices to follow)
    # Which of a request's choices (OpenAI's `n`) this is: only the first counts in the statistics as a request, with
    # its prompt and cached tokens (the others' prompt is its own); every choice counts its completion tokens.
    choice: int = 0

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise RuntimeError("a PromptRequest has either messages or a prompt")


def refuse_unsupported(request: PromptRequest) -> None:
    """Raise RequestError for the fields only upstreams act on (vLLM's and SGLang's own): a local model would
    ignore them, and nothing is silently ignored."""
    if request.extensions:
        name = next(iter(request.extensions))
        raise RequestError(f"{name} is not supported by this model; leave it out", param=name)


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """A request turned into token ids, with its namespace and the keys of its full blocks."""

    token_ids: tuple[int, ...]
    namespace: Namespace
    keys: tuple[BlockKey, ...]  # every full block of the prompt
    reusable: int  # how many of `keys` may be served from cache (never the last prompt token)
    moved: tuple[MovedValue, ...]  # what layout moved out of the static prefix
    messages: list[dict[str, Any]] | None  # as rendered: canonical and laid out
    tenant: str
    retained: tuple[Retained, ...] = ()  # the request's breakpoints, as token counts of this prompt

    def retention(self, block: int, block_size: int) -> float | None:
        """Return the seconds block number `block` is to be kept, the longest of the breakpoints covering it."""
        end = (block + 1) * block_size
        return max((span.seconds for span in self.retained if span.tokens >= end), default=None)

    def cache_writes(self, cached_tokens: int, block_size: int) -> dict[float, int]:
        """Return the prompt tokens computed now and stored at a breakpoint, by the seconds they are kept."""
        writes: dict[float, int] = {}
        if not self.retained:
            return writes  # most requests: no need to walk their blocks
        for block in range(cached_tokens // block_size, len(self.token_ids) // block_size):
            seconds = self.retention(block, block_size)
            if seconds is not None:  # a block partly read from the cache counts only the rest
                computed = (block + 1) * block_size - max(cached_tokens, block * block_size)
                writes[seconds] = writes.get(seconds, 0) + computed
        return writes


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    # Prompt tokens computed now and stored at a breakpoint, by the seconds they are kept (the rest of the computed
    # full blocks are stored too, kept by the tiers' policies alone).
    cache_writes: dict[float, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Rendered:
    """A request's prompt as the model reads it."""

    token_ids: list[int]
    moved: tuple[MovedValue, ...]  # what layout moved out of the static prefix
    messages: list[dict[str, Any]] | None  # canonical and laid out


@dataclass(frozen=True, slots=True)
class Completion:
    """The whole result of a non-streaming request."""

    request_id: str
    text: str
    finish_reason: str
    usage: Usage
    moved: tuple[MovedValue, ...]


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What warming a prompt did: how long it is, how much of it was computed, how much is now cached."""

    prompt_tokens: int
    computed_tokens: int  # prompt tokens the model computed now; the rest of the full blocks were cached already
    cached_tokens: int  # prompt tokens a request with this prompt would now be served from the cache
    read_tokens: int = 0  # prompt tokens that were cached before
    cache_writes: dict[float, int] = field(default_factory=dict)  # as in `Usage`


class Engine:
    """Run prompts through canonicalization, layout, the cache and the model; keep one set of statistics."""

    def __init__(
        self,
        backend: Backend,
        store: TieredStore,
        *,
        rules: CanonicalRules = DEFAULT_RULES,
        patterns: Sequence[DynamicPattern] = DEFAULT_PATTERNS,
        layout: bool = True,
    ) -> None:
        self.backend = backend
        self.store = store
        backend.reads_lent_in(store.slot_order)
        self.stats = EngineStats()
        self._rules = rules
        self._patterns = tuple(patterns)
        self._layout = layout
        self._inflight: dict[BlockKey, asyncio.Future[None]] = {}
        # Blocks handed to the filer and not yet stored: their waiters go on once the filer is done with them, not when
        # the request that computed them ends (a request ending with its last block would leave them a miss).
        self._filing: set[BlockKey] = set()
        # One thread files blocks into the store, in the order the model completes them, off the model's thread.
        # Its copies run on one CPU thread, so it makes no OpenMP pool beside the model's (see prefixgate.threads).
        self._filer = torch_executor("prefixgate-store", workers=1)

    @property
    def model_id(self) -> str:
        """Return the id requests name the model by."""
        return self.backend.model_id

    @property
    def context_length(self) -> int:
        """Return the model's context, in tokens."""
        return self.backend.context_length

    # -- the pipeline -------------------------------------------------------------------------------------------

    async def prepare(self, request: PromptRequest) -> PreparedPrompt:
        """Canonicalize, lay out and render a request; key its blocks in the tenant's namespace."""
        # One worker thread call for all of it: each step is CPU work in proportion to the prompt (a megabyte of text
        # takes a second), which on the event loop would hold up every stream and /health meanwhile.
        return await asyncio.to_thread(self._prepare, request)

    def namespace(self, tenant: str, cache_salt: str | None = None) -> Namespace:
        """Return the namespace of a tenant's blocks (split further by `cache_salt`)."""
        geometry = self.backend.geometry
        return Namespace(
            model_fingerprint=self.backend.fingerprint,
            tokenizer_hash=self.backend.tokenizer_hash,
            dtype=str(geometry.dtype).removeprefix("torch."),
            block_shape=geometry.block_shape,
            # JSON keeps ("a", "b:c") and ("a:b", "c") apart, which joining with a separator would not.
            tenant_salt=json.dumps([tenant, cache_salt]),
        )

    async def generate(self, request: PromptRequest) -> Generation:
        """Start a request and return its token stream once the first token is out (errors surface here)."""
        started = time.perf_counter()
        request_id = f"pg-{uuid.uuid4().hex[:24]}"
        refuse_unsupported(request)
        tool_format = self.backend.tool_format
        grammar = None
        if request.tools or request.response_format:
            # Off the loop: it walks and writes out every tool's schema, which a large body may make long.
            grammar = await asyncio.to_thread(
                answer_grammar,
                request.tools,
                request.tool_choice,
                request.parallel_tool_calls,
                request.response_format,
                tool_format,
            )
        params = replace(
            request.params,
            grammar=grammar,
            skip_special_tokens=request.params.skip_special_tokens and not tool_format.special_markers,
        )
        prepared = await self.prepare(request)
        readers = self._readers(request, prepared, grammar)
        # The context check first, so nothing is done for a request that cannot run; then the cached prefix is found,
        # its shared part read in place where the store's top tier holds it (lent for this request when new), and
        # the request admitted for the rest of its KV memory, into which the rest of the cached prefix is fetched.
        check_context(self.backend.context_length, len(prepared.token_ids), request.params.max_tokens)
        # A request for its prompt's log probabilities computes its whole prompt (a cached prefix has no logits): it
        # reads nothing from the cache, and claims nothing (another request may compute the same blocks meanwhile),
        # but files what it computes, as any request does (a request's further choices read it).
        scored = params.prompt_logprobs is not None
        held, owned = (HeldRun(0, ()), []) if scored else await self._claim(prepared)
        reservation: KVReservation | None = None
        try:
            start = None if scored else await self._start(prepared, held)
            # Takes the start over: it lets go of it when the request ends, or at once if it is refused.
            reservation = await self.backend.reserve(len(prepared.token_ids), request.params.max_tokens, start=start)
            hit = self._nothing_cached(prepared) if scored else await self._load(prepared, reservation)
            # Blocks the load found after all (in the remote tier, or filed meanwhile) are nobody's to compute.
            found = set(prepared.keys[: len(hit.tiers)])
            self._release([key for key in owned if key in found])
            owned = [key for key in owned if key not in found]
            stream = self.backend.generate(
                prepared.token_ids,
                hit.kv,
                params,
                on_block=self._block_filer(prepared, asyncio.get_running_loop()) if self.backend.prefix_reuse else None,
                reservation=reservation,  # the stream owns it from here, and releases it when it ends
                prompt_tail=request.prompt_tail,
            )
        except BaseException as error:
            if reservation is not None:
                reservation.release()
            if isinstance(error, OverloadedError):
                self.stats.count_rejected()
                self._release(owned)
            else:
                self._fail(owned, error)
            raise
        try:
            # The blocks are the request's cache now: keep only where they came from.
            generation = Generation(
                self, request_id, prepared, replace(hit, blocks=()), stream, owned, started, readers, request.choice
            )
            await generation.start()
        except BaseException as error:
            self._fail(owned, error)
            raise
        return generation

    async def complete(self, request: PromptRequest) -> Completion:
        """Run a request to the end and return its text, finish reason and usage."""
        generation = await self.generate(request)
        async with generation:
            text = "".join([chunk.text async for chunk in generation])
        return Completion(
            generation.request_id, text, generation.finish_reason or "stop", generation.usage(), generation.moved
        )

    async def warm(self, request: PromptRequest, *, pinned: bool = False, ttl: float | None = None) -> WarmResult:
        """Compute and store every full block of the prompt without generating; `pinned` and `ttl` apply to all."""
        prepared = await self.prepare(request)
        reservation = await self.backend.reserve(len(prepared.token_ids), 0)
        computed: list[Block] = []

        def on_block(index: int, tokens: Sequence[int], kv: torch.Tensor) -> None:
            # Runs on the model's thread; the blocks are stored together once the prefill is done.
            parent = prepared.keys[index - 1] if index else None
            computed.append(Block(prepared.keys[index], tuple(tokens), kv, parent=parent, tenant=prepared.tenant))

        try:
            hit = await asyncio.to_thread(self._fetch, prepared, None)
        except BaseException:
            reservation.release()
            raise
        computed_tokens = await self.backend.prefill(prepared.token_ids, hit.kv, on_block, reservation=reservation)
        # In a worker thread: the copies below are tensor work, which must neither hold the event loop nor give its
        # thread an OpenMP pool (see prefixgate.threads).
        await asyncio.to_thread(self._keep, prepared, hit.blocks, computed, pinned, ttl)
        match = await asyncio.to_thread(self.store.lookup, prepared.namespace, prepared.token_ids)
        writes = prepared.cache_writes(hit.cached_tokens, hit.block_size)
        return WarmResult(len(prepared.token_ids), computed_tokens, match.cached_tokens, hit.cached_tokens, writes)

    async def explain(self, request: PromptRequest) -> Explanation:
        """Dry-run a request: how it is laid out, what of it is cached where, and why the rest is not."""
        prepared = await self.prepare(request)
        layout = request.messages is not None and request.layout and self._layout
        return await asyncio.to_thread(self._explain, prepared, request.messages, layout)

    async def wait_for_blocks(self) -> None:
        """Wait until every block completed so far is in the store."""
        # A block the model completes as a request ends may still be on its way when the response has gone out. The
        # filer is one thread taking blocks in order, so a no-op handed to it now ends after all of them.
        await asyncio.wrap_future(self._filer.submit(lambda: None))

    async def close(self) -> None:
        """Stop the model, finish filing blocks and close the store."""
        await self.backend.aclose()
        await asyncio.to_thread(self._filer.shutdown, wait=True)
        await asyncio.to_thread(self.store.close)

    # -- preparation, in worker threads ------------------------------------------------------------------------

    def _prepare(self, request: PromptRequest) -> PreparedPrompt:
        backend = self.backend
        # Text far beyond the context is refused by counting characters, before the rules or the tokenizer read it.
        text = None if isinstance(request.prompt, tuple) else request.prompt  # token ids are counted as tokens
        check_prompt_size(request.messages, text, backend.context_length, backend.max_prompt_chars)
        rendered = self._render(request)
        token_ids = rendered.token_ids
        if not token_ids:
            raise RequestError("the prompt renders to no tokens; send some text", param="prompt")
        # Before the keys and the store: a prompt that cannot run is refused for every face, warm included.
        check_context(backend.context_length, len(token_ids))
        namespace = self.namespace(request.tenant, request.cache_salt)
        block_size = backend.geometry.block_size
        keys = tuple(chain_keys(self.store.seed(namespace), token_ids, block_size))
        return PreparedPrompt(
            token_ids=tuple(token_ids),
            namespace=namespace,
            keys=keys,
            reusable=(len(token_ids) - 1) // block_size,
            moved=rendered.moved,
            messages=rendered.messages,
            tenant=request.tenant,
            retained=tuple(self._resolve(request, point, token_ids) for point in request.breakpoints),
        )

    def _render(self, request: PromptRequest) -> Rendered:
        """Canonicalize, lay out and render a request to token ids."""
        moved: tuple[MovedValue, ...] = ()
        messages = None
        if request.messages is not None:
            messages = canonicalize_messages(request.messages, self._rules)
            if request.layout and self._layout:
                laid_out = lay_out(messages, self._patterns)
                messages, moved = laid_out.messages, laid_out.moved
            # tool_choice none: the model is not to call any, so it is not shown them (as vLLM renders it).
            tools = canonicalize_tools(None if request.tool_choice == "none" else request.tools, self._rules)
            token_ids = self.backend.render_chat(messages, tools=tools, template_kwargs=request.template_kwargs)
        elif isinstance(request.prompt, tuple):
            token_ids = list(request.prompt)
            check_token_ids(token_ids, self.backend.vocab_size)
        else:
            assert request.prompt is not None
            token_ids = self.backend.render_text(canonicalize_text(request.prompt, self._rules))
        return Rendered(token_ids, moved, messages)

    def _resolve(self, request: PromptRequest, point: Breakpoint, token_ids: Sequence[int]) -> Retained:
        """Return how many of the prompt's tokens a breakpoint keeps.

        The request cut after the breakpoint is rendered the same way; where its tokens depart from the whole
        prompt's is where the breakpoint lies, whatever the chat template puts around messages and tools (a few of
        the template's tokens after the breakpoint may count with it).
        """
        cut = point.cut(request)
        if cut is None:
            return Retained(len(token_ids), point.seconds)
        try:
            cut_ids = self._render(cut).token_ids
        except RequestError:  # the template takes no such prompt (tools without messages): it keeps nothing
            return Retained(0, point.seconds)
        return Retained(shared_prefix(token_ids, cut_ids), point.seconds)

    def _keep(
        self, prepared: PreparedPrompt, cached: Sequence[Block], computed: list[Block], pinned: bool, ttl: float | None
    ) -> None:
        blocks = computed
        if pinned or ttl is not None:
            # Blocks cached already take the new attributes too; a ttl counts from now, not from their creation.
            # Their tensors are views into the fetched prefix, which the disk writer must not share: copy them.
            blocks = [
                replace(block, kv=block.kv.clone(), created=0.0 if ttl is not None else block.created)  # 0: stamp now
                for block in cached
            ] + computed
        if blocks:
            self.store.put(blocks, pinned=pinned, ttl=ttl)
        self._retain(prepared, len(cached) + len(computed))

    def _explain(self, prepared: PreparedPrompt, original: list[dict[str, Any]] | None, layout: bool) -> Explanation:
        canonical = canonicalize_messages(original, self._rules) if original is not None else None
        return explain_prompt(self.store, self.backend, prepared, original, canonical, self._patterns, layout)

    # -- the cache ----------------------------------------------------------------------------------------------

    def _readers(
        self, request: PromptRequest, prepared: PreparedPrompt, grammar: str | None
    ) -> list[Callable[[TokenChunk], TokenChunk]]:
        """Return what splits a local model's answer as it streams: a reasoning model's chat answer into reasoning
        and content (not one held to a grammar: that is content from its first token), then its content into text
        and tool calls when it has tools to call."""
        readers: list[Callable[[TokenChunk], TokenChunk]] = []
        tags = self.backend.reasoning_tags
        if tags is not None and request.messages is not None and grammar is None:
            # Some templates open the reasoning in the prompt (DeepSeek-R1's), others leave it to the model (Qwen3's).
            opened = self.backend.decode(prepared.token_ids[-32:]).rstrip().endswith(tags[0])
            readers.append(ReasoningStream(tags, opened=opened).chunk)
        if request.tools and request.tool_choice != "none":
            readers.append(ToolCallStream(self.backend.tool_format).chunk)
        return readers

    async def _claim(self, prepared: PreparedPrompt) -> tuple[HeldRun, list[BlockKey]]:
        """Find the cached prefix held here, after waiting for blocks another request is computing; claim the rest.

        Two requests sharing an uncached prefix compute it once: the second waits for the first's blocks, and for
        those filed after them (the first's answer, whose leading tokens it may reuse to the token).
        """
        keys = prepared.keys[: prepared.reusable]
        if not self.backend.prefix_reuse:
            return HeldRun(0, ()), []
        while True:
            held = await asyncio.to_thread(self.store.held, prepared.namespace, prepared.token_ids)
            last_inflight = held.blocks
            while last_inflight < len(keys) and keys[last_inflight] in self._inflight:
                last_inflight += 1
            if last_inflight == held.blocks:
                break
            await asyncio.shield(self._inflight[keys[last_inflight - 1]])
            await self.wait_for_blocks()
        # Claimed with no await since the look, so a request arriving meanwhile waits for these blocks.
        loop = asyncio.get_running_loop()
        owned = [key for key in keys[held.blocks :] if key not in self._inflight]
        for key in owned:
            self._inflight[key] = loop.create_future()
        return held, owned

    async def _start(self, prepared: PreparedPrompt, held: HeldRun) -> PrefixStart | None:
        """Start from the shared prefix of the held blocks, lent by the store when this request made it; None when the
        store's top tier is not memory on the model's device (each request then copies its prefix)."""
        if not self.store.lends:
            return None
        start = self.backend.start_prefix(prepared.keys[: held.blocks], held.forks)
        if start is not None and start.fill is not None:
            try:
                await asyncio.to_thread(self._fill, prepared, start)  # reports the fill even if this request goes
            except BaseException:
                start.release()
                raise
        return start

    async def _load(self, prepared: PreparedPrompt, reservation: KVReservation) -> PrefixHit:
        """Wait for the shared prefixes the request reads, then fetch the rest of its cached prefix into its buffer."""
        if not self.backend.prefix_reuse:
            return self._nothing_cached(prepared)
        shared = await reservation.settle()
        block_size = self.backend.geometry.block_size
        hit = await asyncio.to_thread(self._fetch, prepared, reservation.buffer, shared // block_size)
        return replace(hit, tiers=reservation.shared_tiers + hit.tiers)

    def _nothing_cached(self, prepared: PreparedPrompt) -> PrefixHit:
        """Return the hit of a request that reads nothing from the cache."""
        return PrefixHit(prepared.keys[: prepared.reusable], (), self.backend.geometry.block_size)

    def _fill(self, prepared: PreparedPrompt, start: PrefixStart) -> None:
        """Have the store lend each new shared prefix its blocks in place, parents first, and report each fill,
        whatever happens (others may wait for them; one that fails fails those after it)."""
        while (fill := start.fill) is not None:
            lent = Borrowed.nothing()
            try:
                lent = self.store.borrow(
                    prepared.namespace, prepared.token_ids, start=fill.first_block, stop=fill.blocks
                )
            finally:
                start.filled(lent.kv, lent.tiers, lent.give_back)

    def _fetch(self, prepared: PreparedPrompt, buffer: torch.Tensor | None, start: int = 0) -> PrefixHit:
        """Fetch the cached prefix after its first `start` blocks into `buffer`; extend the retention of the blocks
        the request's breakpoints cover."""
        hit = self.store.fetch(prepared.namespace, prepared.token_ids, buffer, start=start)
        self._retain(prepared, start + len(hit.blocks))
        return hit

    def _retain(self, prepared: PreparedPrompt, blocks: int) -> None:
        """Extend the retention of the prompt's first `blocks` blocks (those held), as its breakpoints ask."""
        if not prepared.retained:
            return  # on every fetch: most requests ask for no retention
        by_seconds: dict[float, list[BlockKey]] = {}
        for index in range(blocks):
            seconds = prepared.retention(index, self.backend.geometry.block_size)
            if seconds is not None:
                by_seconds.setdefault(seconds, []).append(prepared.keys[index])
        for seconds, keys in by_seconds.items():
            self.store.retain(keys, seconds)

    def _fail(self, owned: list[BlockKey], error: BaseException) -> None:
        self._release(owned)
        if not isinstance(error, asyncio.CancelledError):  # a client that left is not an error
            self.stats.count_error()

    def _release(self, owned: list[BlockKey]) -> None:
        """Let waiters go on when a request ends: for blocks it never computed now, for the rest once filed."""
        for key in owned:
            if key in self._filing:
                continue
            future = self._inflight.pop(key, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _block_filer(self, prepared: PreparedPrompt, loop: asyncio.AbstractEventLoop) -> BlockCallback:
        """Return the callback that keys each completed block and files it into the store."""
        keys = list(prepared.keys)
        block_size = self.backend.geometry.block_size
        seed = self.store.seed(prepared.namespace)

        def on_block(index: int, tokens: Sequence[int], kv: torch.Tensor) -> None:
            # Runs on the model's thread: key it (generated tokens extend the chain) and hand it on.
            parent = keys[index - 1] if index else None
            if len(tokens) < block_size:  # a tail: found after its parent, so a first block's is of no use
                if parent is not None:
                    block = Block(tail_key(parent, tokens), tuple(tokens), kv, parent=parent, tenant=prepared.tenant)
                    self._filer.submit(self._file, block, loop, None)
                return
            if index == len(keys):
                keys.append(chain_keys(keys[-1].digest if keys else seed, tokens, block_size)[0])
            block = Block(keys[index], tuple(tokens), kv, parent=parent, tenant=prepared.tenant)
            self._filing.add(block.key)
            self._filer.submit(self._file, block, loop, prepared.retention(index, block_size))

        return on_block

    def _file(self, block: Block, loop: asyncio.AbstractEventLoop, retain: float | None) -> None:
        try:
            self.store.put([block], retain=retain)
        except Exception:  # the request goes on; whoever waits for this block computes it itself
            _log.exception("could not store block %s; it will be computed again", block.key)
            self.stats.count_store_error()
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody left waiting
            # Waiters go on whether or not the block was stored: they fetch it, or compute what is missing.
            loop.call_soon_threadsafe(self._stored, block.key)

    def _stored(self, key: BlockKey) -> None:
        self._filing.discard(key)
        future = self._inflight.pop(key, None)
        if future is not None and not future.done():
            future.set_result(None)


class Generation:
    """The token stream of one started request, with what is known of it so far."""

    system_fingerprint: str | None = None  # OpenAI's; a local model reports none, as vLLM does

    def __init__(
        self,
        engine: Engine,
        request_id: str,
        prepared: PreparedPrompt,
        hit: PrefixHit,
        stream: AsyncIterator[TokenChunk],
        owned: list[BlockKey],
        started: float,
        readers: Sequence[Callable[[TokenChunk], TokenChunk]] = (),
        choice: int = 0,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prepared = prepared
        self.hit = hit
        self.moved = prepared.moved
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.time_to_first_token: float | None = None  # seconds from the engine's start to the first token
        self.duration: float | None = None  # seconds from the engine's start to the generation's end
        self.saved_seconds: float | None = None  # prefill the cache spared, estimated at the model's recent rate
        self.prompt_logprobs: tuple[TokenLogprob, ...] = ()  # the prompt's, where asked for: known once started
        self._stream = stream
        self._owned = owned
        self._started = started
        self._first: TokenChunk | None = None
        self._readers = readers  # what splits the answer's text as it streams: its reasoning, then its tool calls
        self._choice = choice
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        """Return the number of prompt tokens."""
        return len(self.prepared.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Return the prompt tokens served from the cache."""
        return self.hit.cached_tokens

    def usage(self) -> Usage:
        """Return token counts so far."""
        writes = self.prepared.cache_writes(self.hit.cached_tokens, self.hit.block_size)
        return Usage(
            self.prompt_tokens, self.completion_tokens, self.hit.cached_tokens, self.hit.tokens_by_tier, writes
        )

    async def start(self) -> None:
        """Compute up to the first token, so errors come before any response is sent."""
        self._first = await anext(self._stream)
        self.prompt_logprobs = self._first.prompt_logprobs
        self.time_to_first_token = time.perf_counter() - self._started
        self.saved_seconds = self.engine.backend.prefill_seconds(self.hit.cached_tokens)
        if self._choice:  # a request's further choice: the request is counted with its first
            return
        self.engine.stats.count_request(
            self.prompt_tokens,
            self.hit.tokens_by_tier,
            self.time_to_first_token,
            tenant=self.prepared.tenant,
            saved_seconds=self.saved_seconds or 0.0,
            cache_write_tokens=sum(self.usage().cache_writes.values()),
        )

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenChunk:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        if self._first is not None:
            chunk, self._first = self._first, None
        else:
            chunk = await anext(self._stream)
        self.completion_tokens += 1
        for read in self._readers:
            chunk = read(chunk)
        self.finish_reason = chunk.finish_reason
        return chunk

    async def aclose(self) -> None:
        """Stop generating (the model stops within one step); blocks already computed stay cached."""
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()
        self.engine.stats.count_completion(self.completion_tokens)
        self.engine._release(self._owned)
        self.duration = time.perf_counter() - self._started

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
