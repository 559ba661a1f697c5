"""A soak under faults: mixed traffic for a long while, with the Redis tier restarted and the server killed.

Run by hand: `.venv/bin/python benchmarks/soak.py` (30 minutes; `--minutes 3` for a short one). Needs `redis-server`. It
starts a redis-server and `prefixgate serve` (SmolLM2 in float32, so a greedy answer is the same alone, batched or from
the cache; a store folder and a 1 GiB host tier; Redis as the remote tier; three tenants by API key), computes a
reference answer for every prompt of the workload alone, then runs `--clients` clients at once for `--minutes`: OpenAI
chat (one choice, and 3 choices with `n`) and completions and Anthropic messages, streamed and not, greedy, tenants at
random, one request in eight cancelled mid-stream. A third of the way in, Redis is stopped and started again; at two
thirds, the server is killed with SIGKILL and started again on the same store.

It prints requests served, errors by kind (those while the server is down are expected), requests that hung (no answer
within `--hang` seconds: 0 expected), greedy answers that differ from their reference (0 expected; each of a request's
choices is held to the answer of one chat request alone), the server's resident memory after warming up and when it is
killed, and after its restart and at the end, the errors the server logged (0 expected: a request it failed, even one
whose client had left, is one), and a check that reads back every block of the disk tier (0 corrupt expected).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import lmdb
import torch
from batching_bench import own_prefixgate

from prefixgate.backends import HFBackend
from prefixgate.store import BlockLayout
from prefixgate.store.codec import CorruptBlockError, decode
from prefixgate.store.keys import BlockKey
from prefixgate.store.tiered_store import DISK_FOLDER

MODEL = "smollm2-135m"
KEYS = {"sk-acme": "acme", "sk-globex": "globex", "sk-initech": "initech"}
SYSTEMS = [
    "You are the support assistant of the Acme 3000 espresso machine. "
    + " ".join(f"Step {i} of the cleaning routine uses {i * 10} ml of water." for i in range(1, 40)),
    "You answer questions about the train timetable. "
    + " ".join(f"Train {i} leaves at {6 + i % 12}:{i * 7 % 60:02d} from platform {i % 9 + 1}." for i in range(1, 40)),
]
QUESTIONS = ["How much water does step 3 use?", "Which platform does train 12 leave from?", "Say hello.", "Why?"]
PASSWORD = "soak-password"
CHOICES = 3  # of the "chat-n" faces


@dataclass
class Tally:
    """What the clients saw."""

    served: int = 0
    cancelled: int = 0
    hung: int = 0
    differing: list[str] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Processes:
    """The redis-server and the prefixgate server the soak runs, each stopped and started again on its port."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.redis_port = free_port()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis: subprocess.Popen[bytes] | None = None
        self.server: subprocess.Popen[bytes] | None = None
        self.log = (folder / "server.log").open("ab")

    def start_redis(self) -> None:
        redis_server = shutil.which("redis-server")
        assert redis_server is not None, "the soak needs redis-server (apt-get install redis-server)"
        command = [redis_server, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.folder)]
        self.redis = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_redis(self) -> None:
        assert self.redis is not None
        self.redis.terminate()
        self.redis.wait()

    async def start_server(self) -> None:
        command = [own_prefixgate(), "serve", "--port", str(self.port), "--store", str(self.folder / "store")]
        command += ["--dtype", "float32", "--remote", f"redis://:{PASSWORD}@127.0.0.1:{self.redis_port}/0"]
        # A host tier of 1 GiB: it fills within minutes, so memory that grows past it is not the cache filling.
        command += ["--host-budget", "1GiB"]
        for key, tenant in KEYS.items():
            command += ["--api-key", f"{key}={tenant}"]
        env = {key: value for key, value in os.environ.items() if not key.startswith("PREFIXGATE_")}
        self.server = subprocess.Popen(command, stdout=self.log, stderr=self.log, env=env)
        async with aiohttp.ClientSession() as session:
            while True:
                assert self.server.poll() is None, "the server exited; see server.log in the soak folder"
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"{self.url}/health") as response:
                        if response.status == 200:
                            return
                await asyncio.sleep(0.2)

    def kill_server(self) -> None:
        assert self.server is not None
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGINT)
            self.server.wait(timeout=120)
        if self.redis is not None and self.redis.poll() is None:
            self.stop_redis()

    def resident_bytes(self) -> int:
        assert self.server is not None
        for line in Path(f"/proc/{self.server.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


def requests() -> list[tuple[str, str, str]]:
    """Return the workload: (face, system prompt, question)."""
    faces = ["chat", "chat-stream", "chat-n", "chat-n-stream", "completions", "messages", "messages-stream"]
    return [(face, system, question) for face in faces for system in SYSTEMS for question in QUESTIONS]


async def ask(
    session: aiohttp.ClientSession, url: str, key: str, face: str, system: str, question: str, cancel: bool
) -> str | None:
    """Send one greedy request; return its answer's text (its choices' texts a line each, for the "chat-n" faces), or
    None when it was cancelled on purpose."""
    headers = {"Authorization": f"Bearer {key}"}
    if face.startswith("chat"):
        path, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]},
        )
    elif face == "completions":
        path, body = "/v1/completions", {"prompt": f"{system}\nQ: {question}\nA:"}
    else:
        path, body = "/v1/messages", {"system": system, "messages": [{"role": "user", "content": question}]}
    body |= {"model": MODEL, "max_tokens": 24, "temperature": 0, "stream": face.endswith("stream")}
    if face.startswith("chat-n"):
        body["n"] = CHOICES
    async with session.post(f"{url}{path}", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        if not body["stream"]:
            answer = await response.json()
            if face == "messages":
                return "".join(block.get("text", "") for block in answer["content"])
            chat = face.startswith("chat")
            return "\n".join(choice["message"]["content"] if chat else choice["text"] for choice in answer["choices"])
        pieces = []
        by_choice: dict[int, list[str]] = collections.defaultdict(list)
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("type") == "error" or "error" in event:
                raise RuntimeError("error event in the stream")
            if face.startswith("chat") and event.get("choices"):
                choice = event["choices"][0]
                by_choice[choice["index"]].append(choice["delta"].get("content") or "")
                pieces.append(choice["delta"].get("content") or "")
            elif event.get("type") == "content_block_delta":
                pieces.append(event["delta"].get("text", ""))
            if cancel and len(pieces) >= 3:
                return None  # leaving closes the connection: the server stops the request
        if face.startswith("chat"):
            return "\n".join("".join(by_choice[index]) for index in sorted(by_choice))
        return "".join(pieces)


async def client(
    url: str, deadline: float, references: dict[tuple[str, str, str], str], tally: Tally, hang: float, seed: int
) -> None:
    chooser = random.Random(seed)
    workload = list(references)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        while time.monotonic() < deadline:
            face, system, question = chooser.choice(workload)
            cancel = face.endswith("stream") and chooser.random() < 0.125
            try:
                async with asyncio.timeout(hang):
                    answer = await ask(session, url, chooser.choice(list(KEYS)), face, system, question, cancel)
            except TimeoutError:
                tally.hung += 1
                continue
            except (aiohttp.ClientError, RuntimeError, ConnectionError) as error:
                tally.errors[str(error).split(":")[0][:60] or type(error).__name__] += 1
                await asyncio.sleep(0.5)  # the server may be restarting
                continue
            if answer is None:
                tally.cancelled += 1
                continue
            tally.served += 1
            if answer != references[(face, system, question)]:
                tally.differing.append(f"{face} {question!r}: {answer!r} != {references[(face, system, question)]!r}")


def server_errors(folder: Path) -> list[str]:
    """Return the lines the server logged at ERROR level, over both its runs."""
    log = (folder / "server.log").read_text(errors="replace")
    return [line for line in log.splitlines() if " ERROR " in line]


def check_store(folder: Path) -> tuple[int, int]:
    """Read back every block of the disk tier; return (blocks read, corrupt)."""
    backend = HFBackend.load(MODEL, dtype="float32", compile_steps=False)  # read for its layout only
    layout = BlockLayout(backend.geometry.block_shape, backend.geometry.dtype)
    backend.close()
    env = lmdb.open(str(folder / "store" / DISK_FOLDER), readonly=True, lock=False, subdir=True)
    read = corrupt = 0
    with env.begin(buffers=True) as txn:
        for raw_key, value in txn.cursor():
            if len(bytes(raw_key)) != 16:
                continue
            read += 1
            try:
                decode(BlockKey(bytes(raw_key)), value, layout)
            except CorruptBlockError:
                corrupt += 1
    env.close()
    return read, corrupt


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--hang", type=float, default=180.0, help="seconds after which a request counts as hung")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="prefixgate-soak-"))
    processes = Processes(folder)
    tally = Tally()
    try:
        processes.start_redis()
        await processes.start_server()
        references: dict[tuple[str, str, str], str] = {}
        async with aiohttp.ClientSession() as session:
            for face, system, question in requests():  # alone, one at a time, before any fault
                if face.startswith("chat-n"):  # every choice is the answer of one request alone
                    references[(face, system, question)] = "\n".join([references[("chat", system, question)]] * CHOICES)
                    continue
                answer = await ask(session, processes.url, "sk-acme", face, system, question, cancel=False)
                assert answer is not None
                references[(face, system, question)] = answer
        start_rss = processes.resident_bytes()
        started = time.monotonic()
        deadline = started + args.minutes * 60
        clients = [
            asyncio.create_task(client(processes.url, deadline, references, tally, args.hang, seed))
            for seed in range(args.clients)
        ]
        await asyncio.sleep(args.minutes * 60 / 3)
        processes.stop_redis()
        await asyncio.sleep(5)
        processes.start_redis()
        await asyncio.sleep(max(0.0, started + args.minutes * 60 * 2 / 3 - time.monotonic()))
        killed_rss = processes.resident_bytes()
        processes.kill_server()
        await processes.start_server()
        restarted_rss = processes.resident_bytes()
        await asyncio.gather(*clients)
        end_rss = processes.resident_bytes()
    finally:
        processes.stop()
    read, corrupt = check_store(folder)
    print(f"soak: {args.minutes:g} minutes, {args.clients} clients, SmolLM2 float32, Redis restarted, server SIGKILLed")
    print(f"requests served: {tally.served}, cancelled on purpose: {tally.cancelled}, hung: {tally.hung}")
    print(f"errors by kind: {dict(tally.errors) or 'none'}")
    print(f"greedy answers differing from their reference: {len(tally.differing)}")
    for line in tally.differing[:5]:
        print(f"  {line}")
    mib = 1 << 20
    print(
        f"resident memory: {start_rss / mib:.0f} MiB after warming up, {killed_rss / mib:.0f} MiB when killed "
        f"(two thirds in); restarted {restarted_rss / mib:.0f} MiB, {end_rss / mib:.0f} MiB at the end"
    )
    errors = server_errors(folder)
    print(f"server errors logged: {len(errors)}")
    for line in errors[:5]:
        print(f"  {line}")
    print(f"store check: {read} blocks read back from the disk tier, {corrupt} corrupt")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
