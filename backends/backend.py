"""The backend protocol: what the engine asks of a model, and the data it passes across."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

from prefixgate.errors import ContextLengthError, RequestError
from prefixgate.store.block import SlotOrder

if TYPE_CHECKING:  # kv_buffers builds on this module's KVGeometry
    from prefixgate.backends.admission import AdmissionStats
    from prefixgate.backends.kv_buffers import KVReservation
    from prefixgate.backends.shared_prefix import PrefixStart
    from prefixgate.backends.tool_calls import ToolFormat

# A local model stops or runs out of tokens; an upstream may also say "tool_calls" or "content_filter".
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]

BlockCallback = Callable[[int, Sequence[int], torch.Tensor], None]
"""`on_block(block_index, block_token_ids, kv)`: a newly completed block, called from the model's worker thread.

`kv` is a standalone tensor of `KVGeometry.block_shape` on the model's device (never a view into the live cache, and
an ordinary tensor, not an inference tensor); block `i` covers tokens `[i * block_size, (i + 1) * block_size)` of
prompt plus generated tokens. When a generation ends, its last block, still incomplete, comes too (a tail: fewer
token ids than `block_size`, its K and V in the leading positions of `kv`, zeros after), so a later prompt that
continues the conversation can reuse it to the token. It should return quickly (it runs between model steps); an
exception it raises fails the request.
"""

# Bounds of `torch.Generator.manual_seed`: it takes any 64-bit pattern, signed or unsigned.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
_MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # as OpenAI allows


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """Describe the shape and dtype of one KV block of a model."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Return the shape of one block: `[layers, 2, kv_heads, block_size, head_dim]`."""
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def block_nbytes(self) -> int:
        """Return the size of one block in bytes."""
        return math.prod(self.block_shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Say how to pick tokens and when to stop; temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: bool = False  # return each generated token's log probability
    top_logprobs: int = 0  # and this many of the most likely tokens at its position
    # The prompt's tokens' log probabilities too, each with this many of the most likely tokens at its position (vLLM's
    # prompt_logprobs; a completion's echo with logprobs); None: not asked for. The whole prompt is then computed.
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # the end of the turn cannot come before this many (stop strings still apply, as in vLLM)
    ignore_eos: bool = False  # run to max_tokens or a stop string, past the end of the turn
    grammar: str | None = None  # a Lark grammar (llguidance's dialect) the answer must follow
    skip_special_tokens: bool = True  # leave special tokens out of the answer's text

    def __post_init__(self) -> None:
        # Ranges that hold for every model; what depends on the model (its context, its vocabulary) the backend checks.
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        if not (0.0 <= self.temperature <= 2.0):  # also catches NaN
            raise RequestError(f"temperature must be between 0 and 2, got {self.temperature}", param="temperature")
        if not (0.0 < self.top_p <= 1.0):  # also catches NaN
            raise RequestError(f"top_p must be greater than 0 and at most 1, got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or a positive count, got {self.top_k}", param="top_k")
        if self.seed is not None and not (_SEED_MIN <= self.seed <= _SEED_MAX):
            raise RequestError(
                f"seed must be a 64-bit integer (between {_SEED_MIN} and {_SEED_MAX}), got {self.seed}",
                param="seed",
            )
        if len(self.stop) > _MAX_STOP_STRINGS:
            raise RequestError(
                f"at most {_MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}", param="stop"
            )
        if any(not s for s in self.stop):
            raise RequestError("stop strings must not be empty", param="stop")
        for name, value in (("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)):
            if not (-2.0 <= value <= 2.0):  # also catches NaN
                raise RequestError(f"{name} must be between -2 and 2, got {value}", param=name)
        if any(not (-100.0 <= bias <= 100.0) for _, bias in self.logit_bias):
            raise RequestError("each logit_bias value must be between -100 and 100", param="logit_bias")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}", param="top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise RequestError('top_logprobs needs "logprobs": true', param="top_logprobs")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(
                f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.prompt_logprobs}",
                param="prompt_logprobs",
            )
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise RequestError(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
                param="min_tokens",
            )


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call, as OpenAI streams one: the first piece of call `index` names it, later ones add to its
    arguments (JSON text, complete once the answer is)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One candidate token at a position and its log probability."""

    token: str
    logprob: float
    bytes: tuple[int, ...] | None  # the token's UTF-8 bytes (a token may hold part of a character)
    token_id: int | None = None  # where the model's vocabulary is known here (a local model)
    rank: int | None = None  # its place among the vocabulary's log probabilities, from 1 (a local model's prompt)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log probability, and the most likely tokens at its position when they were asked for."""

    token: str
    logprob: float | None  # None only for a prompt's first token, which has nothing before it
    bytes: tuple[int, ...] | None
    top: tuple[TopLogprob, ...] = ()
    token_id: int | None = None  # as in TopLogprob
    rank: int | None = None


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Carry one generated token and what became stable with it; the last one has a finish reason.

    Text is the answer's content. An upstream also sends what agents read beside it: tool-call pieces, reasoning,
    a refusal, and log probabilities, which go to the client as they came.
    """

    token_id: int
    text: str
    finish_reason: FinishReason | None
    stop_sequence: str | None = None  # the stop string that ended the answer, when one did
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""
    refusal: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    # On the first chunk, where asked for (`SamplingParams.prompt_logprobs`): each prompt token's log probability given
    # the tokens before it (the first's None)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str = "prompt") -> None:
    """Raise RequestError, naming the body's field `param`, unless every id is in a vocabulary of `vocab_size`."""
    outside = next((token for token in token_ids if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise RequestError(
            f"token {outside} is outside this model's vocabulary: ids run from 0 to {vocab_size - 1}", param=param
        )


def check_context(context_length: int, prompt_tokens: int, max_tokens: int = 0) -> None:
    """Raise ContextLengthError unless a prompt and `max_tokens` more fit a context of `context_length` tokens."""
    if prompt_tokens > context_length:
        raise ContextLengthError(
            f"this model's maximum context length is {context_length} tokens, but the prompt has {prompt_tokens}; "
            "shorten the prompt",
            param="prompt",
        )
    if prompt_tokens + max_tokens > context_length:
        raise ContextLengthError(
            f"this model's maximum context length is {context_length} tokens; the prompt has {prompt_tokens} and "
            f"max_tokens asks for {max_tokens} more; lower max_tokens to at most {context_length - prompt_tokens}",
            param="max_tokens",
        )


@runtime_checkable
class Backend(Protocol):
    """Render prompts to token ids and generate from them, starting from cached KV blocks."""

    model_id: str
    fingerprint: str
    tokenizer_hash: str
    geometry: KVGeometry
    context_length: int
    vocab_size: int  # token ids run from 0 to vocab_size - 1
    # The most characters a prompt that fits the context can have, whitespace or not, however it is normalized or
    # rendered; None when the tokenizer gives no such bound. Longer text is refused without tokenizing it.
    max_prompt_chars: int | None
    prefix_reuse: bool
    reuse_refusal: str | None
    tool_format: ToolFormat  # how the model writes tool calls, by its chat template
    # The tags a reasoning model thinks between, by its chat template (`<think>`, `</think>`); None for others.
    reasoning_tags: tuple[str, str] | None
    steps: str  # how the model's steps run: "eager", "compiling" (eager until done) or "compiled"
    # The order a store's top tier lays its slots out in for the steps to read the prefixes it lends where they lie,
    # unpacked (`TieredStore.open(order=)`, `cpu_attention.KernelOrder`); None: token order.
    slot_order: SlotOrder | None

    def reads_lent_in(self, order: SlotOrder | None) -> None:
        """Read the prefixes the store lends (`start_prefix`'s fills) as lying in `order`, its top tier's
        (`TieredStore.slot_order`); raises ValueError for an order the steps do not read. Said once, before any
        request."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render chat messages with the model's own template, ending with the assistant's turn; `template_kwargs` are
        the template's other variables (Qwen3's enable_thinking, say).

        Blocking (call it in a worker thread). Raises ContextLengthError, without tokenizing, for a rendering longer
        in characters than any prompt that fits the context; a shorter one may still have too many tokens.
        """
        ...

    def render_text(self, prompt: str) -> list[int]:
        """Tokenize a plain completion prompt; blocking, and refusing text beyond any context as render_chat does."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text, leaving out special tokens unless asked."""
        ...

    def start_prefix(self, block_ids: Sequence[Hashable], forks: Sequence[int] = ()) -> PrefixStart | None:
        """Start a request from one shared copy of its cached prefix: `block_ids` name its leading blocks held in the
        store (block 0 first), `forks` where other cached prompts depart from it. None: nothing to share.

        A start with a `fill` made a new shared prefix: have the store lend its blocks in place
        (`TieredStore.borrow`) and call `filled()` at once, whatever happens to the request. Pass the start to
        `reserve`.
        """
        ...

    async def reserve(self, prompt_tokens: int, max_tokens: int, *, start: PrefixStart | None = None) -> KVReservation:
        """Wait until the request may run: its prompt and answer fit the context and the KV memory budget.

        Raises ContextLengthError before allocating anything, and OverloadedError when the wait queue is full. With
        a `start` (taken over: released with the reservation, or at once on failure) it is admitted for what follows
        the shared prefix only; `await settle()` before using the buffer. The reservation's `buffer` (None without
        reuse) is where to fetch the cached prefix after `offset` (`TieredStore.fetch(..., out=, start=)`); blocks
        passed to generate() or prefill() as its leading slices are used in place. Pass it to one generate() or
        prefill(), which takes it over and releases it when the request ends; release it yourself only if you pass
        it to neither.
        """
        ...

    def admission(self) -> AdmissionStats:
        """Return how many requests run and wait, and the KV memory the running ones hold."""
        ...

    def problem(self) -> str | None:
        """Say why the backend cannot serve, or None while it can."""
        ...

    def prefill_seconds(self, tokens: int) -> float | None:
        """Return what computing a prompt's first `tokens` tokens would take, as measured lately (what a cache hit of
        that many tokens spared); None before any prompt was."""
        ...

    def generate(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        params: SamplingParams,
        on_block: BlockCallback | None = None,
        *,
        reservation: KVReservation | None = None,
        prompt_tail: bool = False,
    ) -> AsyncIterator[TokenChunk]:
        """Stream the continuation of `token_ids`, starting from the KV of `cached_blocks` (block 0 first).

        Every cached block is whole but the last, which may hold only its leading positions (a partial block).
        Without a `reservation` the stream reserves its own on its first iteration, waiting as `reserve` does. With
        `prompt_tail`, the prompt's partial last block also goes to `on_block` before the first token (for requests
        about to follow on the same prompt, as a request's other choices do).
        """
        ...

    async def prefill(
        self,
        token_ids: Sequence[int],
        cached_blocks: Sequence[torch.Tensor],
        on_block: BlockCallback | None,
        *,
        reservation: KVReservation | None = None,
    ) -> int:
        """Compute the prompt's blocks past `cached_blocks` and hand them to `on_block`; return tokens computed."""
        ...

    async def aclose(self) -> None:
        """Stop the backend: cancel running work and release the model."""
        ...
