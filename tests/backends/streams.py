"""Run generations to the end and collect what a backend hands out: tokens, text and KV blocks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from prefixgate.backends import HFBackend, KVReservation, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@dataclass
class BlockSink:
    """Collect handed-back blocks in order, with the thread each one arrived on."""

    indices: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    blocks: list[torch.Tensor] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)

    def __call__(self, index: int, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        self.indices.append(index)
        self.tokens.append(list(token_ids))
        self.blocks.append(kv)
        self.threads.add(threading.current_thread().name)


@dataclass(frozen=True)
class Generation:
    """Everything one finished generation streamed."""

    token_ids: list[int]
    texts: list[str]
    finish_reason: str | None

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(
    backend: HFBackend,
    prompt: Sequence[int],
    blocks: Sequence[torch.Tensor] = (),
    params: SamplingParams = GREEDY,
    on_block: BlockSink | None = None,
    reservation: KVReservation | None = None,
) -> Generation:
    """Stream one generation to its end (admitted with `reservation`, when given, as the engine admits one)."""
    token_ids: list[int] = []
    texts: list[str] = []
    finish: str | None = None
    async for chunk in backend.generate(prompt, blocks, params, on_block, reservation=reservation):
        assert finish is None, "no chunk may follow the one with a finish reason"
        token_ids.append(chunk.token_id)
        texts.append(chunk.text)
        finish = chunk.finish_reason
    return Generation(token_ids, texts, finish)


@contextlib.contextmanager
def transformers_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run the model with transformers' own eager attention inside the block, whatever a backend switched it to."""
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)


def transformers_greedy(model: PreTrainedModel, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Return the greedy continuation from transformers' own `generate` and attention, never stopping early."""
    with torch.inference_mode(), transformers_attention(model):
        output = model.generate(  # type: ignore[operator]
            torch.tensor([list(prompt)]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return [int(t) for t in output[0, len(prompt) :]]
