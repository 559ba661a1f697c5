"""Routing by prefix against round robin, in front of two upstream replicas whose caches each hold about half the
working set.

Run by hand: `.venv/bin/python benchmarks/routing_bench.py` (about nine minutes on 2 CPU cores). It starts two
`prefixgate serve` processes on SmolLM2 as the upstreams, each with its cache in memory and a host tier of six tenths
of the working set, and a third in front of them with `--upstream`. The workload is `--prompts` distinct system prompts
of about `--prompt-tokens` tokens with `--questions` questions each, asked prompt after prompt, question after
question (so each prompt comes back after all the others), one request at a time, one token each:

- round robin: the client sends request i to replica i mod 2 itself;
- prefix: the client sends every request to the server in front, which routes it.

The replicas' caches are flushed between the two runs. For each it prints the fleet hit rate (cached over prompt
tokens, as the replicas report them) and time to first token p50 and p95; then the routing decision's own cost,
measured in this process on a table as large as the run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from prefixgate.backends.router import PrefixRouter, text_keys

MODEL = "smollm2-135m"
ADMIN_KEY = "routing-bench"
BYTES_PER_TOKEN = 46 * 1024  # SmolLM2's KV in float32


@contextlib.contextmanager
def served(*flags: str) -> Iterator[str]:
    """Run `prefixgate serve` on a free local port; yield its base URL once it answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "prefixgate.proxy.cli", "serve", "--port", str(port), *flags]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                assert process.stderr is not None
                raise RuntimeError(f"prefixgate serve exited: {process.stderr.read().decode()[-2000:]}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait()


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


def run(urls: list[str], pairs: list[tuple[str, str]]) -> dict[str, float]:
    """Send every pair, request i to urls[i % len(urls)]; return hit rate and time to first token percentiles."""
    seconds, prompt, cached = [], 0, 0
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
        cached += usage["prompt_tokens_details"]["cached_tokens"]
    quantiles = statistics.quantiles(seconds, n=20)
    return {
        "hit_rate": cached / prompt,
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
    args = parser.parse_args()
    pairs = workload(args.prompts, args.questions, args.prompt_tokens)
    # Room for a little more than half the prompts: routed by prefix, each replica holds its own half; round robin,
    # each sees every prompt in turn, and least-recently-used keeps none until it comes back.
    half = int(args.prompts * args.prompt_tokens * BYTES_PER_TOKEN * 0.6)
    flags = ("--store", "", "--host-budget", str(half), "--admin-key", ADMIN_KEY)
    with served(*flags) as first, served(*flags) as second:
        replicas = [first, second]
        with served("--store", "", *[flag for url in replicas for flag in ("--upstream", f"{url}/v1")]) as front:
            warm_up = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            for replica in replicas:
                post(f"{replica}/v1/chat/completions", warm_up)
            results = {"round robin": run([f"{url}/v1" for url in replicas], pairs)}
            for replica in replicas:
                post(f"{replica}/admin/cache/flush", {}, ADMIN_KEY)
            results["prefix"] = run([f"{front}/v1"], pairs)
    cost = decision_microseconds(args.prompts, args.questions, args.prompt_tokens)
    print(
        f"SmolLM2 on {args.prompts} prompts x {args.questions} questions, {results['prefix']['prompt_tokens']:.0f} "
        f"prompt tokens a request; two replicas with {half / 2**20:.0f} MiB of host tier each (six tenths of the "
        "working set); one request at a time, max_tokens 1"
    )
    print("| routing | hit rate | TTFT p50 | TTFT p95 |\n| --- | --- | --- | --- |")
    for name, result in results.items():
        print(f"| {name} | {result['hit_rate']:.2f} | {result['p50'] * 1e3:.0f} ms | {result['p95'] * 1e3:.0f} ms |")
    rr, prefix = results["round robin"], results["prefix"]
    print(f"p50 round robin / prefix: {rr['p50'] / prefix['p50']:.1f}x; routing decision: {cost:.0f} us per request")


if __name__ == "__main__":
    sys.exit(main())
