"""Measure prefixgate end to end through HTTP, on SmolLM2: time to first token cold and warm for a 4k-token system
prompt, and the proxy's own overhead against calling the engine in-process.

Run by hand: `.venv/bin/python benchmarks/http_bench.py`. The server runs in this process on 127.0.0.1 (the real
aiohttp app, the real engine, a store in a temporary folder); the client is aiohttp over a kept-alive connection.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from prefixgate.backends import SamplingParams
from prefixgate.proxy.app import ENGINE, SERVE_OPTIONS, create_app
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.settings import load_settings

MODEL = "smollm2-135m"
QUESTIONS = [f"In one sentence: what does section {i} of the report say?" for i in range(1, 40)]


def system_prompt(engine: Engine, tokens: int, variant: int) -> str:
    """Return a system prompt of about `tokens` tokens; each variant differs from its first word on."""
    lines = [f"Variant {variant}. You answer questions about this report."]
    lines += [
        f"Section {i}: in quarter {i % 4 + 1} node {i % 13} served {i * 37 % 101} requests per second "
        f"with a cache hit rate of {i * 7 % 100} percent after change {i * 11}."
        for i in range(1, 400)
    ]
    text = "\n".join(lines)
    ids = engine.backend.render_text(text)[:tokens]
    return engine.backend.decode(ids)


def chat_body(system: str, question: str, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
    }
    return body | fields


async def http_ttft(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, int]:
    """Return seconds to the first content chunk of a streamed request, and its cached tokens."""
    start = time.perf_counter()
    async with session.post(url, json=body | {"stream": True}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: ") and b'"content"' in line and b'"role"' not in line:
                seconds = time.perf_counter() - start
                break
        else:
            raise AssertionError("no content chunk")
        cached = int(response.headers["x-prefixgate-cached-tokens"])
        await response.read()
    return seconds, cached


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--warm", type=int, default=7, help="warm requests (median)")
    parser.add_argument("--overhead-runs", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        settings = load_settings(store=Path(folder) / "store")
        app = create_app(settings)
        runner = web.AppRunner(app, access_log=None, **SERVE_OPTIONS)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        engine = app[ENGINE]
        try:
            async with aiohttp.ClientSession() as session:
                await http_ttft(session, url, chat_body("Hello.", "Hi"))  # warm up kernels and the connection
                colds, warms, cached = [], [], []
                for variant in range(2):
                    system = system_prompt(engine, args.prefix_tokens, variant)
                    seconds, hit = await http_ttft(session, url, chat_body(system, QUESTIONS[0]))
                    assert hit == 0
                    colds.append(seconds)
                for question in QUESTIONS[1 : 1 + args.warm]:
                    seconds, hit = await http_ttft(session, url, chat_body(system, question))
                    warms.append(seconds)
                    cached.append(hit)

                # Overhead: the same small cached request, whole (not streamed), through HTTP and in-process.
                body = chat_body("You are brief.", "Say hi.")
                request = PromptRequest(params=SamplingParams(max_tokens=1, temperature=0.0), messages=body["messages"])
                await engine.complete(request)
                through_http, in_process = [], []
                for _ in range(args.overhead_runs):
                    start = time.perf_counter()
                    async with session.post(url, json=body) as response:
                        await response.json()
                    through_http.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    await engine.complete(request)
                    in_process.append(time.perf_counter() - start)
        finally:
            await runner.cleanup()

    cold, warm = statistics.median(colds), statistics.median(warms)
    http_ms, engine_ms = statistics.median(through_http) * 1e3, statistics.median(in_process) * 1e3
    # Each HTTP run is paired with the in-process run right after it, so a slow moment of the machine falls on both.
    overhead_ms = statistics.median(h - e for h, e in zip(through_http, in_process, strict=True)) * 1e3
    print(f"SmolLM2-135M-Instruct through HTTP, {args.prefix_tokens}-token system prompt + a short question")
    rows = [
        ("time to first token, cold (median of 2)", f"{cold * 1e3:.0f} ms", ""),
        (f"time to first token, warm (median of {len(warms)})", f"{warm * 1e3:.0f} ms", f"{min(cached)} cached tokens"),
        ("cold / warm", f"{cold / warm:.1f}x", "target >= 20x"),
        (f"small cached request via HTTP (median of {args.overhead_runs})", f"{http_ms:.2f} ms", ""),
        (f"same request, engine in-process (median of {args.overhead_runs})", f"{engine_ms:.2f} ms", ""),
        ("proxy overhead per request (median of pairs)", f"{overhead_ms:.2f} ms", "target < 2 ms"),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    asyncio.run(main())
