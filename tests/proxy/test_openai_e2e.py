"""End to end: `prefixgate serve` on the real SmolLM2, driven by the official `openai` client, and by the official
`anthropic` client through its example."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.proxy.conftest import metric_families, sample
from tests.services import Server

pytestmark = pytest.mark.smollm2

MODEL = "smollm2-135m"
MANUAL = "You are the support assistant for the Acme 3000 espresso machine. Answer from this manual.\n" + "\n".join(
    f"Section {i}: step {i} of the cleaning routine uses {i * 10} ml of water at {60 + i % 30} degrees."
    for i in range(1, 61)
)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*flags: str) -> Server:
        server = Server(tmp_path / "store", *flags)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def ask(client: openai.OpenAI, question: str, system: str = MANUAL) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=24,
        temperature=0,
    )


def test_chat_and_completions_streaming_and_not(start_server: Callable[..., Server]) -> None:
    client = start_server().client()
    reply = client.chat.completions.create(
        model=MODEL,
        # Not "What is the capital of France?": bfloat16 ties its first two tokens, `The` and `L` (README, "The dtype:
        # speed and quality"); this one is 1.4 logits clear of the next, eager or compiled.
        messages=[{"role": "user", "content": "Name the capital of France."}],
        max_tokens=20,
        temperature=0,
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name the capital of France."}],
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens

    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert completion.choices[0].text and completion.usage is not None
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == completion.choices[0].text

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)


def test_a_shared_long_system_prompt_is_served_from_cache_with_the_same_answer(
    start_server: Callable[..., Server],
) -> None:
    # float32: a cached prefix then gives exactly the answer computing it gives (in bfloat16 a near tie may part).
    client = start_server("--dtype", "float32").client()
    first = ask(client, "How much water does step 3 use?")
    second = ask(client, "How much water does step 3 use?")
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens > 1000
    assert first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 1000
    assert second.choices[0].message.content == first.choices[0].message.content
    other = ask(client, "What temperature does step 7 need?")  # same manual, another question: still a hit
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens >= 1000


def test_n_choices_through_the_openai_client_whole_and_streamed(start_server: Callable[..., Server]) -> None:
    # float32: each choice is exactly the greedy answer of a request alone, though they share the prompt's blocks.
    client = start_server("--dtype", "float32").client()
    question = "How much water does step 3 use?"
    alone = ask(client, question)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "system", "content": MANUAL},
        {"role": "user", "content": question},
    ]
    both = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, n=2)
    assert [choice.index for choice in both.choices] == [0, 1]
    assert [choice.message.content for choice in both.choices] == [alone.choices[0].message.content] * 2
    assert both.usage is not None and alone.usage is not None
    assert both.usage.completion_tokens == 2 * alone.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [alone.choices[0].message.content] * 2


def test_a_restarted_server_serves_the_prefix_from_disk(start_server: Callable[..., Server]) -> None:
    first_server = start_server("--dtype", "float32")
    first = ask(first_server.client(), "How much water does step 5 use?")
    first_server.stop()

    second_server = start_server("--dtype", "float32")
    again = ask(second_server.client(), "How much water does step 5 use?")
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 1000
    assert again.choices[0].message.content == first.choices[0].message.content
    metrics = metric_families(second_server.metrics())
    disk_tokens = sample(metrics, "prefixgate_prefix_cache_hits_by_tier_total", model_name=MODEL, tier="disk")
    assert disk_tokens == sample(metrics, "prefixgate_prefix_cache_hits_total") >= 1000
    assert sample(metrics, "prefixgate_prefix_cache_queries_total") == again.usage.prompt_tokens


def test_the_openai_client_example_shows_cached_tokens(start_server: Callable[..., Server]) -> None:
    server = start_server()
    example = Path(__file__).parents[2] / "examples" / "openai_client.py"
    result = subprocess.run(
        [sys.executable, str(example), "--base-url", f"{server.url}/v1"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    cached = [int(line.split(", ")[1].split()[0]) for line in result.stdout.splitlines() if "from the cache" in line]
    assert cached[0] == 0 and cached[1] >= 1000


def test_the_anthropic_client_example_reads_its_breakpoint_from_the_cache(start_server: Callable[..., Server]) -> None:
    server = start_server()
    example = Path(__file__).parents[2] / "examples" / "anthropic_client.py"
    result = subprocess.run(
        [sys.executable, str(example), "--base-url", server.url], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    # "   input tokens: W written to the cache, R read from it, O other; ..."
    usage = [
        [int(part.split()[0]) for part in line.split(": ")[1].split("; ")[0].split(", ")]
        for line in result.stdout.splitlines()
        if "written to the cache" in line
    ]
    (written, read, _), (written_again, read_again, other_again) = usage
    assert written >= 1000 and read == 0  # the system prompt, up to its breakpoint, computed and stored
    assert written_again == 0 and read_again >= written and other_again < 100  # and to the token past it
    answers = [line.removeprefix("A: ") for line in result.stdout.splitlines() if line.startswith("A: ")]
    assert len(answers) == 2 and all(answer.strip() for answer in answers)
