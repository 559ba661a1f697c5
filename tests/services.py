"""Real processes that tests start on free local ports: `prefixgate serve`, llama.cpp's server, a redis-server, a Redis
Cluster."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import redis

LLAMA_SERVER = shutil.which("llama-server")  # llama.cpp's server, where it is installed
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
PASSWORD = "test-password-5d1e"  # Redis requires it, so every test goes through credentials in the URL


def free_port() -> int:
    """Return a local TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_health(process: subprocess.Popen[bytes], url: str, output: Callable[[], str], seconds: float) -> None:
    """Wait until `url/health` answers 200 (a server still loading answers 503); fail with `output()` if the process
    ends first or it takes longer than `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, output()
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.25)
    raise AssertionError(f"the server did not start:\n{output()}")


class LlamaServer:
    """llama.cpp's `llama-server` on a free local port, serving a GGUF file as `alias`, with its chat templates."""

    def __init__(self, gguf: Path, alias: str) -> None:
        assert LLAMA_SERVER is not None, "llama-server is not installed"
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        command = [LLAMA_SERVER, "-m", str(gguf), "--alias", alias, "--jinja", "--host", "127.0.0.1", "--port", port]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for_health(self.process, self.url, self.output, seconds=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def output(self) -> str:
        self.stop()
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")


def free_cluster_port() -> int:
    """Return a free port for a Redis Cluster node: its bus port, 10000 above it, must be a free port too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class Server:
    """A `prefixgate serve` process on a free local port (or `port`), with its store in `store`."""

    def __init__(self, store: Path, *flags: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "prefixgate.proxy.cli", "serve", "--port", str(self.port)]
        env = {key: value for key, value in os.environ.items() if not key.startswith("PREFIXGATE_")}
        # Steps compiled in the background would swap in midway, changing bfloat16's rounding between two answers that
        # tests compare; tests/backends/test_smollm2.py covers compiled steps.
        eager = [] if "--compile" in flags else ["--compile", "off"]
        self.process = subprocess.Popen(
            [*command, "--store", str(store), *eager, *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        # The first start on a machine converts the model (~30 s).
        wait_for_health(self.process, self.url, self.output, seconds=180)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def get(self, path: str) -> str:
        return urllib.request.urlopen(f"{self.url}{path}").read().decode()

    def metrics(self) -> str:
        return self.get("/metrics")

    def stop(self) -> None:
        """Stop as an operator would (Ctrl-C): the app closes the store, finishing its disk writes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(timeout=60)

    def output(self) -> str:
        self.stop()
        assert self.process.stdout is not None
        return self.process.stdout.read().decode(errors="replace")


class RedisServer:
    """A real redis-server on a free port, with no persistence, that a test may stop and start again on that port."""

    def __init__(self, folder: Path, *options: str, port: int | None = None) -> None:
        assert REDIS_SERVER is not None
        self.folder = folder
        self.port = port or free_port()
        self.url = f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"
        self.options = options
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and return once it answers PING."""
        assert REDIS_SERVER is not None and self._process is None
        command = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--requirepass", PASSWORD]
        command += ["--save", "", "--appendonly", "no", "--dir", str(self.folder), *self.options]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        try:
            for _ in range(400):  # it answers within milliseconds; the bound only stops a broken start hanging
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self._process.poll() is not None:
                        raise RuntimeError(f"redis-server exited with {self._process.returncode}") from None
                    time.sleep(0.025)
            raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
        finally:
            client.close()

    def freeze(self) -> None:
        """Suspend the server (SIGSTOP): it keeps its connections and answers nothing until `thaw`."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """Resume a frozen server (SIGCONT), with what it held."""
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server, if it runs; everything it held is gone."""
        if self._process is None:
            return
        self._process.terminate()
        self._process.wait(timeout=30)
        self._process = None

    def client(self) -> redis.Redis:
        """Return a plain client, for what a test does to Redis behind prefixgate's back."""
        return redis.Redis.from_url(self.url)


class RedisClusterNodes:
    """Three redis-servers joined by `redis-cli --cluster create` into one Redis Cluster, every slot covered."""

    def __init__(self, folder: Path, count: int = 3) -> None:
        self.nodes = []
        for index in range(count):
            node_folder = folder / f"node{index}"
            node_folder.mkdir(parents=True)
            options = ("--cluster-enabled", "yes", "--masterauth", PASSWORD)
            self.nodes.append(RedisServer(node_folder, *options, port=free_cluster_port()))
        self.urls = tuple(node.url.removesuffix("/0") for node in self.nodes)  # a cluster has database 0 only

    def start(self) -> None:
        """Start the nodes, create the cluster, and return once every node reports it whole."""
        assert REDIS_CLI is not None
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            [REDIS_CLI, "-a", PASSWORD, "--no-auth-warning", "--cluster", "create", *addresses, "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for node in self.nodes:
            client = node.client()
            try:
                for _ in range(400):  # the nodes agree within a second or two; the bound only stops a hang
                    if client.cluster("INFO")["cluster_state"] == "ok":
                        break
                    time.sleep(0.05)
                else:
                    raise RuntimeError(f"the cluster node on port {node.port} never reported the cluster ok")
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
