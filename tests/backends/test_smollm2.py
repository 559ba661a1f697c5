"""The embedded default model, SmolLM2-135M-Instruct: chat template, a real answer, and reuse of a long prefix.

The first run converts the package's GGUF into `~/.cache/prefixgate/models` (about 30 s); later runs load it in
about a second.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from prefixgate.backends import (
    EMBEDDED_MODEL,
    HFBackend,
    SamplingParams,
    StepRecord,
    TokenChunk,
    packed_linear,
    resolve_model,
)
from prefixgate.backends.hf_backend import auto_dtype
from prefixgate.backends.model_resolver import embedded_gguf_path
from prefixgate.backends.model_runner import StepInput
from prefixgate.backends.packed_linear import PackedLinear, packs
from tests.backends.streams import BlockSink, collect
from tests.backends.test_compiled_steps import attention_calls
from tests.backends.test_shared_prefix import start_shared

pytestmark = pytest.mark.smollm2

ANSWER = SamplingParams(max_tokens=20, temperature=0.0)
_steps: list[StepRecord] = []


def long_system_prompt() -> str:
    """Return a deterministic system prompt of roughly 1,000 tokens."""
    rules = [
        f"Rule {i}: when a question concerns subject number {i}, answer in one short, accurate sentence."
        for i in range(1, 46)
    ]
    return "You are a concise geography tutor.\n" + "\n".join(rules)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[HFBackend]:
    """Load the embedded default model once for this module."""
    # float32, where a request's greedy tokens are the same alone, batched or from the cache: what these tests check.
    # In bfloat16 (the default on CPUs that compute it) rounding depends on the batch, and answers may part at near
    # ties; benchmarks/quality_bench.py measures how often.
    backend = HFBackend.load(EMBEDDED_MODEL, dtype="float32", compile_steps=False, on_step=_steps.append)
    yield backend
    backend.close()


def test_the_chat_template_renders_chatml(smollm2: HFBackend) -> None:
    ids = smollm2.render_chat([{"role": "user", "content": "Hello"}])
    text = smollm2.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nHello<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert smollm2.model_id == EMBEDDED_MODEL
    assert smollm2.prefix_reuse
    assert smollm2.geometry.block_shape == (30, 2, 3, 64, 64)


def test_render_chat_gives_the_templates_tokens_and_a_bound_far_past_the_context(smollm2: HFBackend) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(EMBEDDED_MODEL).folder))
    messages = [
        {"role": "system", "content": "Be brief.\n\n   "},
        {"role": "user", "content": "Is <|im_end|> a token? naïve café 🙂\t\tyes"},
    ]
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert smollm2.render_chat(messages) == encoded["input_ids"]
    # Its longest token is 81 characters (a newline and 80 spaces): 8,192 tokens never hold more than 8192 * 81 * 4.
    assert smollm2.max_prompt_chars == 8192 * 81 * 4


def test_a_gguf_path_resolves_to_the_same_converted_folder(smollm2: HFBackend) -> None:
    by_name = resolve_model(EMBEDDED_MODEL)
    by_path = resolve_model(str(embedded_gguf_path()))
    assert by_path.folder == by_name.folder
    assert by_path.source == "gguf" and by_name.source == "embedded"


def test_a_reinstalled_gguf_reuses_its_converted_folder(smollm2: HFBackend, tmp_path: Path) -> None:
    converted = resolve_model(EMBEDDED_MODEL).folder
    # A reinstall, or a copy, puts the same bytes at another path with another mtime.
    copy = tmp_path / embedded_gguf_path().name
    shutil.copyfile(embedded_gguf_path(), copy)
    os.utime(copy, ns=(0, 10**18))
    assert resolve_model(str(copy)).folder == converted


async def test_it_knows_the_capital_of_france(smollm2: HFBackend) -> None:
    prompt = smollm2.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = await collect(smollm2, prompt, params=ANSWER)
    assert "Paris" in result.text


async def test_its_prompt_log_probabilities_find_paris_likely_and_a_wrong_city_not(smollm2: HFBackend) -> None:
    # The scoring a loglikelihood evaluation asks of a completion with echo and logprobs: the last prompt token's.
    scores = {}
    for city in (" Paris", " Madrid"):
        prompt = smollm2.render_text("The capital of France is" + city)
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
        chunks = [chunk async for chunk in smollm2.generate(prompt, [], params)]
        entries = chunks[0].prompt_logprobs
        assert [entry.token for entry in entries] == [smollm2._token_text(token) for token in prompt]
        scores[city] = entries[-1].logprob
    assert scores[" Paris"] is not None and scores[" Madrid"] is not None
    assert scores[" Paris"] > math.log(0.3) > scores[" Madrid"]


@pytest.mark.skipif(
    not packs(torch.float32) or not packed_linear._kernel(),
    reason="float32 linear layers run on the C kernel on AMD's x86 CPUs where it builds (AVX2, FMA, a C compiler)",
)
def test_its_linear_weights_are_held_as_the_codes_of_its_gguf_blocks(smollm2: HFBackend) -> None:
    # The embedded file's Q4_1 and Q8_0 blocks, which transformers loads as float32: the C kernel rebuilds each weight
    # to the bit as it reads it (tests/backends/test_packed_linear.py), from a fifth of the bytes.
    layers = {id(m): m for m in smollm2._runner.model.modules() if isinstance(m, PackedLinear)}
    assert len(layers) == smollm2.prepacked == 211
    held = [layer.layout["codes"].dtype for layer in layers.values()]
    assert held.count(torch.uint8) == 210 and held.count(torch.int8) == 1  # Q4_1 two codes to a byte, Q8_0 int8


@pytest.mark.skipif(
    not packs(auto_dtype(torch.device("cpu"))[0]),
    reason="compiling SmolLM2 (a minute or more) is tested where --compile auto compiles it, on CPUs where its weights "
    "are prepacked; the tiny model's compiled steps are tested everywhere (test_compiled_steps.py)",
)
async def test_compiled_steps_give_the_logits_of_eager_ones_and_the_capital_of_france(smollm2: HFBackend) -> None:
    # float32, where compiled and eager steps agree to rounding. In bfloat16 they part at near ties, as batches do
    # (here: float32's two best first tokens are 0.09 apart); benchmarks/quality_bench.py measures how often.
    backend = HFBackend.load(EMBEDDED_MODEL, dtype="float32", compile_steps=True)  # a first compile takes a minute
    try:
        assert backend.compiling is not None
        await asyncio.to_thread(backend.compiling.join)
        assert backend.steps == "compiled"
        prompt = backend.render_chat([{"role": "user", "content": "What is the capital of France?"}])
        g = backend.geometry
        buffers = [torch.zeros((g.layers, 2, g.kv_heads, len(prompt), g.head_dim)) for _ in range(2)]
        with torch.inference_mode(), attention_calls() as calls:
            logits = backend._runner.run([StepInput(prompt, buffers[0], 0)])
        assert calls == []  # the compiled graph took the step: no layer ran its Python
        with torch.inference_mode():  # the module's backend runs its steps eagerly
            expected = smollm2._runner.run([StepInput(prompt, buffers[1], 0)])
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
        assert "Paris" in (await collect(backend, prompt, params=ANSWER)).text
    finally:
        backend.close()


async def test_a_shared_long_system_prompt_is_reused_and_gives_the_same_answer(smollm2: HFBackend) -> None:
    system = {"role": "system", "content": long_system_prompt()}
    first = smollm2.render_chat([system, {"role": "user", "content": "What is the capital of France?"}])
    second = smollm2.render_chat([system, {"role": "user", "content": "What is the capital of Italy?"}])
    assert len(first) > 1000
    sink = BlockSink()
    await collect(smollm2, first, params=ANSWER, on_block=sink)
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    usable = shared // smollm2.geometry.block_size
    assert usable >= 15
    assert all(sink.tokens[i] == second[i * 64 : (i + 1) * 64] for i in range(usable))

    _steps.clear()
    reused = await collect(smollm2, second, sink.blocks[:usable], params=ANSWER)
    computed = sum(s.tokens("prefill") for s in _steps)
    assert computed == len(second) - usable * 64
    full = await collect(smollm2, second, params=ANSWER)
    assert reused.token_ids == full.token_ids
    assert reused.text == full.text


async def test_questions_answered_together_get_the_answers_each_gets_alone(smollm2: HFBackend) -> None:
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "What is 12 times 12?",
        "Write a haiku about the sea.",
    ]
    prompts = [smollm2.render_chat([{"role": "user", "content": q}]) for q in questions]
    alone = [await collect(smollm2, prompt, params=ANSWER) for prompt in prompts]
    _steps.clear()
    together = await asyncio.gather(*(collect(smollm2, prompt, params=ANSWER) for prompt in prompts))
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert "Paris" in together[0].text
    assert max(len(step.seq_ids()) for step in _steps) == 4, "the four shared forward passes"


async def test_questions_reading_one_shared_system_prompt_get_the_answers_each_gets_alone(smollm2: HFBackend) -> None:
    system = {"role": "system", "content": long_system_prompt()}
    questions = ["What is the capital of France?", "What is the capital of Italy?", "Name a large ocean."]
    prompts = [smollm2.render_chat([system, {"role": "user", "content": q}]) for q in questions]
    alone = [await collect(smollm2, prompt, params=ANSWER) for prompt in prompts]
    sink = BlockSink()
    await collect(smollm2, prompts[0], params=ANSWER, on_block=sink)
    shared = next(i for i, (a, b) in enumerate(zip(*prompts[:2], strict=False)) if a != b) // 64
    reservations = [await start_shared(smollm2, prompt, sink.blocks[:shared], ANSWER.max_tokens) for prompt in prompts]
    assert smollm2.admission().shared_prefixes == 1 and all(r.offset == shared * 64 for r in reservations)
    streams = [smollm2.generate(p, [], ANSWER, reservation=r) for p, r in zip(prompts, reservations, strict=True)]

    async def tokens(stream: AsyncIterator[TokenChunk]) -> list[int]:
        return [chunk.token_id async for chunk in stream]

    together = await asyncio.gather(*(tokens(stream) for stream in streams))
    assert together == [g.token_ids for g in alone]
    assert smollm2.admission().shared_prefixes == 0
