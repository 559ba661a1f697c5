"""What bfloat16 changes in SmolLM2's answers: greedy tokens and logits against float32, on the server's own steps.

Run by hand: `.venv/bin/python benchmarks/quality_bench.py` (about six minutes on 2 cores of an Intel Xeon with AMX;
`--short 10 --long 1` makes it a few). It loads SmolLM2 twice, in float32 and in bfloat16, and runs each prompt
through the packed steps the server runs (chunked prefill into a KV buffer, then one decode step per token):

- float32 answers greedily (`--tokens` tokens, 64): the reference;
- bfloat16 is fed the same prompt and then the reference answer token by token (teacher forcing). At each step it
  agrees when its own greedy choice is the reference token; up to its first disagreement it is exactly what bfloat16
  answers alone, so an answer with no disagreement is the same answer word for word.

Short prompts are chat questions alone. Long ones are questions after a cached system prompt (a document of
`--document-tokens` tokens): the document's K and V are computed once per dtype and copied into each question's
buffer, as the server starts a request from its cached prefix, so the question and answer attend over cached KV.

It prints, for each kind and both together: prompts, tokens compared, greedy agreement, answers identical to
float32 word for word, the largest and the median largest logit difference per answer, and the share of
disagreements where float32's own top two choices were within 0.5 logits of each other (a near tie, which any change
of summation order may flip).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixgate.backends import HFBackend, KVReservation
from prefixgate.backends.model_runner import StepInput

TOPICS = (
    "photosynthesis",
    "the French Revolution",
    "binary search",
    "compound interest",
    "volcanoes",
    "the water cycle",
    "TCP handshakes",
    "Shakespeare's sonnets",
    "black holes",
    "vaccines",
)
TASKS = (
    "Explain {} to a ten-year-old.",
    "Give three facts about {}.",
    "Write a short poem about {}.",
    "What is a common misconception about {}?",
    "Summarize {} in two sentences.",
)
QUESTIONS = (
    "Which node served the most requests per second in the report, and in which quarter?",
    "Summarize the report in three sentences.",
    "What did the team note about the cache hit rate?",
    "List the change numbers mentioned in the first five sections.",
    "Which section mentions node 7, and what was measured there?",
)
CHUNK = 512  # prompt tokens a prefill step takes, as the server's default chunk


@dataclass(frozen=True, slots=True)
class Answer:
    """One prompt's comparison: steps where bfloat16 chose float32's token, of how many; the largest logit gap."""

    agreed: int
    steps: int
    near_ties: int  # of the disagreements, those where float32's top two were within 0.5 logits
    largest_difference: float


class Runner:
    """One model's packed steps over a KV buffer of its own."""

    def __init__(self, backend: HFBackend, capacity: int) -> None:
        self.backend = backend
        self.runner = backend._runner  # the backend's own: its steps (compiled, where they are) are the server's
        reservation = KVReservation(backend._buffers, capacity, capacity, lambda: None)
        assert reservation.buffer is not None
        self.buffer = reservation.buffer  # buffer: [layers, 2, kv_heads, capacity, head_dim]

    def prefill(self, tokens: Sequence[int], start: int = 0) -> torch.Tensor:
        """Compute `tokens` after the first `start` positions; return the last one's logits."""
        logits = torch.empty(0)
        for begin in range(0, len(tokens), CHUNK):
            logits = self.runner.run([StepInput(tokens[begin : begin + CHUNK], self.buffer, start + begin)])[0]
        return logits  # logits: [vocab], float32

    def step(self, token: int, position: int) -> torch.Tensor:
        """Feed one token at `position`; return the next one's logits."""
        return self.runner.run([StepInput([token], self.buffer, position)])[0]


def compare(
    reference: Runner, candidate: Runner, prompt: Sequence[int], start: int, tokens: int, eos: int | None
) -> Answer:
    """Answer `prompt` (its first `start` tokens already in both buffers) greedily in float32, and feed that answer to
    bfloat16; return how they compare."""
    agreed = near_ties = steps = 0
    largest = 0.0
    logits = reference.prefill(prompt[start:], start)
    other = candidate.prefill(prompt[start:], start)
    for position in range(len(prompt), len(prompt) + tokens):
        steps += 1
        top2 = logits.topk(2)
        token = int(top2.indices[0])
        largest = max(largest, float((logits - other).abs().max()))
        if int(other.argmax()) == token:
            agreed += 1
        elif float(top2.values[0] - top2.values[1]) < 0.5:
            near_ties += 1
        if token == eos:
            break
        logits, other = reference.step(token, position), candidate.step(token, position)
    return Answer(agreed, steps, near_ties, largest)


def document(backend: HFBackend, count: int) -> str:
    """Return a deterministic report of at least `count` tokens."""
    paragraphs = [
        f"Section {i}. In quarter {i % 4 + 1} the team measured {i * 37 % 101} requests per second on node "
        f"{i % 13}, and noted that cache hit rate {i * 7 % 100} percent followed change number {i * 11}."
        for i in range(1 + count // 40)
    ]
    text = "\n".join(paragraphs)
    assert len(backend.render_text(text)) >= count, "the document is too short"
    return text


def common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Return how many leading tokens every prompt shares."""
    length = 0
    for column in zip(*prompts, strict=False):
        if len(set(column)) > 1:
            break
        length += 1
    return min(length, *(len(prompt) - 1 for prompt in prompts))


def summary(name: str, answers: Sequence[Answer]) -> str:
    agreed = sum(answer.agreed for answer in answers)
    steps = sum(answer.steps for answer in answers)
    identical = sum(answer.agreed == answer.steps for answer in answers)
    disagreed = steps - agreed
    ties = sum(answer.near_ties for answer in answers)
    largest = [answer.largest_difference for answer in answers]
    return (
        f"{name:>5} | {len(answers):>7} | {steps:>6} | {100 * agreed / steps:>8.1f} % "
        f"| {identical:>4} of {len(answers):<3}"
        f" | {max(largest):>7.2f} | {statistics.median(largest):>6.2f} | "
        + (f"{ties} of {disagreed}" if disagreed else "none")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=len(TOPICS) * len(TASKS), help="chat questions alone (up to 50)")
    parser.add_argument("--long", type=int, default=2, help="documents, each with its questions after it")
    parser.add_argument("--document-tokens", type=int, default=3000)
    parser.add_argument("--tokens", type=int, default=64, help="answer tokens compared per prompt")
    args = parser.parse_args()

    started = time.perf_counter()
    backends = [HFBackend.load("smollm2-135m", dtype=dtype) for dtype in ("float32", "bfloat16")]
    for backend in backends:
        if backend.compiling is not None:
            backend.compiling.join()  # the steps as served once compiled
    capacity = args.document_tokens + 600 * args.long + 512  # the longest document, a question and its answer
    float32, bfloat16 = (Runner(backend, capacity) for backend in backends)
    eos = backends[0]._tokenizer.eos_token_id
    short = [
        backends[0].render_chat([{"role": "user", "content": task.format(topic)}]) for task in TASKS for topic in TOPICS
    ][: args.short]
    with torch.inference_mode():
        short_answers = [compare(float32, bfloat16, prompt, 0, args.tokens, eos) for prompt in short]
        long_answers = []
        for index in range(args.long):
            report = document(backends[0], args.document_tokens + 600 * index)
            system = f"You answer questions about report {index + 1} below.\n\n{report}"
            prompts = [
                backends[0].render_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
                for question in QUESTIONS
            ]
            cached = common_prefix(prompts)
            kept = {}
            for runner in (float32, bfloat16):  # the document once per dtype, as the cache holds it
                runner.prefill(prompts[0][:cached])
                kept[runner] = runner.buffer[:, :, :, :cached].clone()  # [layers, 2, kv_heads, cached, head_dim]
            for prompt in prompts:
                for runner in (float32, bfloat16):  # each question starts from a copy of the cached prefix
                    runner.buffer[:, :, :, :cached] = kept[runner]
                long_answers.append(compare(float32, bfloat16, prompt, cached, args.tokens, eos))
    print(
        f"SmolLM2-135M-Instruct, bfloat16 (steps {backends[1].steps}) against float32, {args.tokens} greedy tokens "
        f"per prompt, CPU, {torch.get_num_threads()} threads; {time.perf_counter() - started:.0f} s"
    )
    print()
    print("kind  | prompts | tokens | agreement  | identical | largest | median | disagreements at near ties")
    print("----- | ------- | ------ | ---------- | --------- | ------- | ------ | --------------------------")
    for name, answers in (("short", short_answers), ("long", long_answers), ("all", short_answers + long_answers)):
        if answers:
            print(summary(name, answers))
    print()
    print("largest and median: the largest logit difference in an answer (the largest of all, the median over answers)")


if __name__ == "__main__":
    main()
