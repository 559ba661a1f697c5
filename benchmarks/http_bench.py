"""Measure prefixgate end to end through HTTP, on SmolLM2: time to first token cold and warm for a 4k-token system
prompt, and the proxy's own overhead against calling the engine in-process.

Run by hand: `.venv/bin/python benchmarks/http_bench.py`. The server runs in this process on 127.0.0.1: the real
aiohttp app and engine, served as `prefixgate serve` serves them (its access log written to /dev/null), with a store
in a temporary folder. Time to first token is measured with aiohttp's client; the overhead with a bare HTTP/1.1
client in a process of its own, as a real client would be.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from prefixgate.backends import SamplingParams
from prefixgate.proxy.app import SERVE_OPTIONS, create_app
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.serving import ENGINE
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


def aligned_system_prompt(engine: Engine, tokens: int, variant: int) -> str:
    """Return a system prompt of at most `tokens` tokens after which the questions start on a block boundary."""
    size = engine.backend.geometry.block_size
    for shorter in range(size):
        system = system_prompt(engine, tokens - shorter, variant)
        renders = [engine.backend.render_chat(chat_body(system, question)["messages"]) for question in QUESTIONS[:2]]
        shared = next(i for i, (a, b) in enumerate(zip(*renders, strict=False)) if a != b)
        if shared % size == 0:
            return system
    raise RuntimeError(f"no system prompt of up to {tokens} tokens ends on a block boundary")


def chat_body(system: str, question: str, **fields: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
    }
    return body | fields


class ClientProcess:
    """A bare HTTP/1.1 client in a process of its own: blocking socket, one kept-alive connection, requests made
    beforehand. It times each exchange itself, from sending the request to having read the whole response, so it
    counts what a client on another machine would wait for, and no client library's work."""

    def __init__(self, port: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of this one's model threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_client_loop, args=(port, child), daemon=True)
        self._process.start()

    async def exchange(self, request: bytes) -> tuple[float, dict[str, str]]:
        """Have the client send `request`; return its round trip in seconds and the response's headers."""
        loop = asyncio.get_running_loop()
        answered = loop.create_future()
        loop.add_reader(self._conn.fileno(), lambda: answered.done() or answered.set_result(None))
        try:
            self._conn.send_bytes(request)
            await answered  # this loop serves the request meanwhile
        finally:
            loop.remove_reader(self._conn.fileno())
        seconds, headers = self._conn.recv()
        return seconds, headers

    def close(self) -> None:
        self._conn.send_bytes(b"")
        self._process.join()


def _client_loop(port: int, conn: Connection) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        response = sock.makefile("rb")
        while request := conn.recv_bytes():
            start = time.perf_counter()
            sock.sendall(request)
            status = response.readline()
            headers = {}
            while (line := response.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                headers[name.lower()] = value.strip()
            body = response.read(int(headers["content-length"]))
            seconds = time.perf_counter() - start
            assert status.split()[1] == b"200", body
            conn.send((seconds, headers))


def post(path: str, body: dict[str, Any]) -> bytes:
    """Return an HTTP/1.1 request posting `body` as JSON."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data


def small_system_prompt(engine: Engine) -> str:
    """Return a system prompt whose chat renders to one block and one token, so all but its last token are cached."""
    target = engine.backend.geometry.block_size + 1
    for tokens in range(target):
        system = system_prompt(engine, tokens, variant=2)
        messages = chat_body(system, "Say hi.")["messages"]
        if len(engine.backend.render_chat(messages)) == target:
            return system
    raise RuntimeError(f"no system prompt renders to {target} tokens")


def server_timing(header: str) -> dict[str, float]:
    """Parse a Server-Timing header into milliseconds by metric name."""
    metrics = (metric.partition(";dur=") for metric in header.split(", "))
    return {name: float(rest.partition(";")[0]) for name, _, rest in metrics}  # ";desc=..." may follow


def ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f} ms"


def quartiles(seconds: list[float]) -> str:
    low, _, high = statistics.quantiles(seconds, n=4)
    return f"{low * 1e3:.1f} to {high * 1e3:.1f} ms"


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
    parser.add_argument("--overhead-runs", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        settings = load_settings(store=Path(folder) / "store")
        app = create_app(settings)
        # As `prefixgate serve` runs it: its access log on, here written to /dev/null.
        access_log = logging.getLogger("aiohttp.access")
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
        access_log.addHandler(logging.FileHandler(os.devnull))
        runner = web.AppRunner(app, access_log=access_log, **SERVE_OPTIONS)
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
                # The same with a system prompt after which the question starts on a block boundary: the prefix is
                # whole blocks, and nothing of the block after it is shared.
                system = aligned_system_prompt(engine, args.prefix_tokens, variant=3)
                await http_ttft(session, url, chat_body(system, QUESTIONS[0]))
                aligned, aligned_cached = [], []
                for question in QUESTIONS[1 : 1 + args.warm]:
                    seconds, hit = await http_ttft(session, url, chat_body(system, question))
                    aligned.append(seconds)
                    aligned_cached.append(hit)

                # Overhead: a small request whose prompt is cached but for its last token, through HTTP and
                # in-process, alternately and in alternating order.
                body = chat_body(small_system_prompt(engine), "Say hi.")
                request = PromptRequest(params=SamplingParams(max_tokens=1, temperature=0.0), messages=body["messages"])
                await engine.complete(request)
                small_cached = (await engine.complete(request)).usage.cached_tokens
                client = ClientProcess(port)
                raw_request = post("/v1/chat/completions", body)
                await client.exchange(raw_request)
                through_http, engine_in_http, in_process = [], [], []
                for run in range(args.overhead_runs):
                    for step in ("http", "in-process") if run % 2 == 0 else ("in-process", "http"):
                        if step == "http":
                            seconds, headers = await client.exchange(raw_request)
                            through_http.append(seconds)
                            engine_in_http.append(server_timing(headers["server-timing"])["engine"] / 1e3)
                        else:
                            start = time.perf_counter()
                            await engine.complete(request)
                            in_process.append(time.perf_counter() - start)
                # The floor: a trivial request right after a model step, and right after that one.
                health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                floor: dict[str, list[float]] = {"after a model step": [], "after another request": []}
                for _ in range(args.overhead_runs // 2):
                    await engine.complete(request)
                    for when in floor:
                        floor[when].append((await client.exchange(health))[0])
                client.close()
        finally:
            await runner.cleanup()

    cold, warm = statistics.median(colds), statistics.median(warms)
    n = args.overhead_runs
    # The overhead of each HTTP request is its round trip less the engine's own time in it (from Server-Timing), so
    # the model's run-to-run spread, which is far larger than the overhead, cancels out exactly.
    overhead = [h - e for h, e in zip(through_http, engine_in_http, strict=True)]
    # Cross-check, noisier: each HTTP run against the in-process run beside it.
    paired = [h - e for h, e in zip(through_http, in_process, strict=True)]
    print(f"SmolLM2-135M-Instruct through HTTP, {args.prefix_tokens}-token system prompt + a short question")
    rows = [
        ("time to first token, cold (median of 2)", f"{cold * 1e3:.0f} ms", ""),
        (f"time to first token, warm (median of {len(warms)})", f"{warm * 1e3:.0f} ms", f"{min(cached)} cached tokens"),
        (
            "warm, the question starting on a block boundary",
            f"{statistics.median(aligned) * 1e3:.0f} ms",
            f"{min(aligned_cached)} cached tokens",
        ),
        ("cold / warm", f"{cold / warm:.1f}x", "target >= 20x"),
        (f"small request via HTTP (median of {n})", ms(through_http), f"{small_cached} cached tokens, 1 computed"),
        (f"same request, engine in-process (median of {n})", ms(in_process), ""),
        ("engine time inside the HTTP requests", ms(engine_in_http), "from Server-Timing"),
        ("proxy overhead per request", ms(overhead), "target < 2 ms; round trip less engine time"),
        ("HTTP less the in-process run beside it", ms(paired), f"cross-check; quartiles {quartiles(paired)}"),
        *((f"GET /health {when}", ms(seconds), "whole round trip") for when, seconds in floor.items()),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


if __name__ == "__main__":
    asyncio.run(main())
