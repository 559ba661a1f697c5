"""The Python decorator: sync and async functions, streaming, options, a server target, two processes, bad use.

Everything runs the real engine on the tiny random-weight Llama; the server target is the real app on a real port.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, model_runner
from prefixgate.backends.packed_linear import packs
from prefixgate.errors import ConfigError, RequestError
from prefixgate.proxy import PromptCache, Reply, ServerError
from prefixgate.proxy.app import SERVE_OPTIONS, create_app
from prefixgate.proxy.engine import Engine
from prefixgate.proxy.settings import Settings, load_settings
from tests.proxy.conftest import BLOCK_SIZE, MODEL, SYSTEM, tiny_engine

REPOSITORY = Path(__file__).resolve().parents[3]
QUESTION = "What is the capital of France?"
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0.0}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def make_cache(folder: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel) -> PromptCache:
    """Return a cache over the tiny engine, storing under `folder`."""
    settings = load_settings(model=MODEL, store=folder)
    return PromptCache.from_engine(tiny_engine(settings, tokenizer, llama, []))


@pytest.fixture
def cache(tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel) -> Iterator[PromptCache]:
    with make_cache(tmp_path / "store", tokenizer, llama) as cache:
        yield cache


@pytest.fixture(scope="module")
def model_folder(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel
) -> Path:
    """Save the tiny Llama as a model folder, so `PromptCache.open` (and other processes) can load it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# -- in process ---------------------------------------------------------------------------------------------------


def test_a_sync_function_returns_a_reply_with_text_finish_reason_and_usage(cache: PromptCache) -> None:
    @cache.cached(**GREEDY)
    def ask(question: str) -> list[dict[str, str]]:
        """Ask about the manual."""
        return chat(question)

    reply = ask(QUESTION)
    assert isinstance(reply, Reply) and reply.text and str(reply) == reply.text
    assert reply.finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 60 and reply.usage.completion_tokens <= 6 and reply.usage.cached_tokens == 0
    assert ask.__name__ == "ask" and ask.__doc__ == "Ask about the manual."


def test_a_repeated_long_system_prompt_is_served_from_the_cache_with_the_same_greedy_answer(cache: PromptCache) -> None:
    ask = cache.cached(**GREEDY)(chat)
    first, second = ask(QUESTION), ask(QUESTION)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == second.usage.prompt_tokens - 1  # all but the last token
    assert second.text == first.text and second.finish_reason == first.finish_reason


def test_with_options_overrides_settings_for_that_call_only(cache: PromptCache) -> None:
    ask = cache.cached(max_tokens=6, temperature=0.0, stop=["\x00never"])(chat)
    short = ask.with_options(max_tokens=1)(QUESTION)
    assert short.usage.completion_tokens == 1 and short.finish_reason == "length"
    assert ask(QUESTION).usage.completion_tokens > 1
    assert ask.options.params.max_tokens == 6 and ask.options.params.stop == ("\x00never",)


def test_a_cache_salt_keeps_prefixes_apart(cache: PromptCache) -> None:
    ask = cache.cached(**GREEDY)(chat)
    ask(QUESTION)
    salted = ask.with_options(cache_salt="team-b")
    assert salted(QUESTION).usage.cached_tokens == 0
    assert salted(QUESTION).usage.cached_tokens > 0


def test_a_plain_string_goes_to_the_completion_path(cache: PromptCache) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    complete = cache.cached(**GREEDY)(lambda: prompt)
    reply = complete()
    assert cache.engine is not None
    # A completion prompt is tokenized as it is; the chat path would have wrapped it in the chat template.
    assert reply.usage.prompt_tokens == len(cache.engine.backend.render_text(prompt))
    assert reply.text


async def test_an_async_function_gives_an_awaitable_reply_from_the_callers_own_loop(cache: PromptCache) -> None:
    @cache.cached(**GREEDY)
    async def ask(question: str) -> list[dict[str, str]]:
        await asyncio.sleep(0)
        return chat(question)

    replies = await asyncio.gather(ask(QUESTION), ask("What is the capital of Italy?"))
    assert all(isinstance(reply, Reply) and reply.text for reply in replies)
    assert (await ask(QUESTION)).text == replies[0].text


def test_a_sync_stream_yields_the_text_in_pieces_and_then_the_whole_reply(cache: PromptCache) -> None:
    ask = cache.cached(**GREEDY)(chat)
    whole = ask(QUESTION)
    stream = ask.stream(QUESTION)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert stream.reply.text == whole.text and stream.reply.usage.cached_tokens > 0


async def test_an_async_stream_yields_the_text_in_pieces_and_then_the_whole_reply(cache: PromptCache) -> None:
    @cache.cached(**GREEDY)
    async def ask(question: str) -> list[dict[str, str]]:
        return chat(question)

    whole = await ask(QUESTION)
    async with ask.stream(QUESTION) as stream:
        pieces = [piece async for piece in stream]
    assert len(pieces) > 1 and "".join(pieces) == whole.text
    assert stream.reply == Reply(whole.text, whole.finish_reason, stream.reply.usage)


def test_a_stream_left_early_has_no_reply_and_the_cache_keeps_answering(cache: PromptCache) -> None:
    ask = cache.cached(max_tokens=200, temperature=0.0)(chat)
    with ask.stream(QUESTION) as stream:
        first = next(stream)
    assert first and list(stream) == []
    with pytest.raises(RuntimeError, match="exhausted"):
        _ = stream.reply
    assert ask.with_options(max_tokens=2)(QUESTION).usage.completion_tokens == 2


def test_open_loads_a_model_folder_with_the_servers_settings(model_folder: Path, tmp_path: Path) -> None:
    with PromptCache.open(model=str(model_folder), store=tmp_path / "store", block_size=BLOCK_SIZE) as cache:
        ask = cache.cached(**GREEDY)(chat)
        ask(QUESTION)
        assert ask(QUESTION).usage.cached_tokens > 0
        assert cache.engine is not None and cache.engine.backend.geometry.block_size == BLOCK_SIZE
    assert (tmp_path / "store" / "secret").is_file()


def test_open_runs_steps_eagerly_unless_a_compile_setting_says_otherwise(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtype = next((name for name in ("bfloat16", "float32") if packs(getattr(torch, name))), None)
    if dtype is None:
        pytest.skip("no linear weights are prepacked here: `auto` would not compile anyway")

    def unavailable(function: Any, **options: Any) -> Any:
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(model_runner.torch, "compile", unavailable)
    # In this dtype on this CPU the linear weights are packed, where `prefixgate serve` would compile by default.
    with PromptCache.open(model=str(model_folder), store="", dtype=dtype) as cache:
        assert cache.engine is not None and cache.engine.backend.compiling is None
    monkeypatch.setenv("PREFIXGATE_COMPILE", "auto")
    with PromptCache.open(model=str(model_folder), store="", dtype=dtype) as cache:
        assert cache.engine is not None
        backend = cache.engine.backend
        assert isinstance(backend, HFBackend) and backend.compiling is not None
        backend.compiling.join()  # it tried, and the stub refused
        assert backend.steps == "eager"


# -- two processes ------------------------------------------------------------------------------------------------

# Process A: opens the store, answers one question, prints the reply as JSON and exits without close(): at exit the
# cache writes the blocks still queued for the disk.
PROCESS_A = """
import json, sys
from prefixgate.proxy import PromptCache
folder, store, system, question = sys.argv[1:]
cache = PromptCache.open(model=folder, store=store, block_size=8)
ask = cache.cached(max_tokens=6, temperature=0.0)(
    lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
)
reply = ask(question)
print(json.dumps({"text": reply.text, "cached": reply.usage.cached_tokens}))
"""


def test_two_processes_share_the_cache_through_one_store_folder(model_folder: Path, tmp_path: Path) -> None:
    store = tmp_path / "shared-store"
    # This process opens the store first, so it sees blocks another process writes while it is running.
    with PromptCache.open(model=str(model_folder), store=store, block_size=BLOCK_SIZE) as cache:
        argv = [sys.executable, "-c", PROCESS_A, str(model_folder), str(store), SYSTEM, QUESTION]
        done = subprocess.run(argv, cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        other = json.loads(done.stdout.strip().splitlines()[-1])
        assert other["cached"] == 0

        reply = cache.cached(**GREEDY)(chat)(QUESTION)
        assert reply.usage.cached_tokens > 0
        assert reply.text == other["text"]
        assert cache.engine is not None
        assert cache.engine.stats.cached_tokens == {"disk": reply.usage.cached_tokens}  # nothing came from memory


# -- a server target ----------------------------------------------------------------------------------------------


class ServerThread:
    """The real app on a real port, served from an event loop in a thread of its own."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(app, **SERVE_OPTIONS)
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)

    async def _start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def server(tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel) -> Iterator[Callable[..., str]]:
    """Start the real app over the tiny engine; settings are keyword arguments; return its URL."""
    servers: list[ServerThread] = []

    def start(**overrides: Any) -> str:
        overrides.setdefault("store", tmp_path / "server-store")
        overrides.setdefault("model", MODEL)

        async def factory(settings: Settings) -> Engine:
            return tiny_engine(settings, tokenizer, llama, [])

        servers.append(ServerThread(create_app(load_settings(**overrides), factory)))
        return servers[-1].url

    yield start
    for running in servers:
        running.stop()


def test_the_same_function_on_a_server_gives_the_same_reply_and_caches(
    server: Callable[..., str], cache: PromptCache
) -> None:
    url = server()
    with PromptCache.connect(url) as remote:
        assert remote.engine is None
        here, there = cache.cached(**GREEDY)(chat), remote.cached(**GREEDY)(chat)
        local, first, second = here(QUESTION), there(QUESTION), there(QUESTION)
        assert type(first) is Reply and first.text == local.text and first.finish_reason == local.finish_reason
        assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens == local.usage.prompt_tokens
        assert second.usage.cached_tokens > 0 and second.text == first.text

        stream = there.stream(QUESTION)
        assert "".join(stream) == first.text and stream.reply.usage.cached_tokens > 0
        prompt = "The quick brown fox jumps over the lazy dog."
        assert remote.cached(**GREEDY)(lambda: prompt)() == cache.cached(**GREEDY)(lambda: prompt)()


async def test_an_async_function_streams_from_a_server(server: Callable[..., str]) -> None:
    url = server()
    async with PromptCache.connect(url + "/v1/") as remote:

        @remote.cached(**GREEDY)
        async def ask(question: str) -> list[dict[str, str]]:
            return chat(question)

        whole = await ask(QUESTION)
        stream = ask.stream(QUESTION)
        assert "".join([piece async for piece in stream]) == whole.text
        assert stream.reply.usage.completion_tokens == whole.usage.completion_tokens


def test_a_server_error_becomes_a_request_error_with_the_servers_message(server: Callable[..., str]) -> None:
    url = server(api_keys={"key-a": "acme"})
    with pytest.raises(RequestError, match="valid API key is required"):
        PromptCache.connect(url)
    with PromptCache.connect(url, api_key="key-a", model="gpt-4o") as remote:
        with pytest.raises(RequestError, match="'gpt-4o' does not exist") as caught:
            remote.cached(**GREEDY)(chat)(QUESTION)
        assert caught.value.param == "model"


@pytest.mark.parametrize("body", [b"", b"<html>Not Found</html>"])
def test_an_address_that_is_no_prefixgate_server_says_so(body: bytes) -> None:
    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, body=body, content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    other = ServerThread(app)
    try:
        with pytest.raises(RequestError, match=f"HTTP 404 Not Found with no OpenAI error; is {other.url} a prefixgate"):
            PromptCache.connect(other.url)
    finally:
        other.stop()


def test_an_unreachable_server_is_a_server_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free now, and nothing listens on it once the probe closes
    with pytest.raises(ServerError, match=f"cannot reach the prefixgate server at http://127.0.0.1:{port}"):
        PromptCache.connect(f"http://127.0.0.1:{port}")


# -- bad use ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("returned", [42, None, {"role": "user", "content": "one message, not a list"}])
def test_a_function_returning_neither_messages_nor_a_string_says_what_to_return(
    cache: PromptCache, returned: object
) -> None:
    @cache.cached(**GREEDY)
    def wrong() -> str:
        return returned  # type: ignore[return-value]  # what an untyped application could do

    with pytest.raises(
        TypeError,
        match=re.escape("wrong() returned") + ".*" + re.escape("return chat messages, a list like [{'role': 'user'"),
    ):
        wrong()


def test_malformed_or_empty_prompts_are_request_errors(cache: PromptCache) -> None:
    with pytest.raises(RequestError, match=re.escape("messages the chat API refuses: 0.role")) as caught:
        cache.cached(**GREEDY)(lambda: [{"role": "robot", "content": "beep"}])()
    assert caught.value.param == "messages"
    with pytest.raises(RequestError, match="returned no messages"):
        cache.cached(**GREEDY)(lambda: [])()
    with pytest.raises(RequestError, match="returned an empty prompt"):
        cache.cached(**GREEDY)(lambda: "")()


def test_unknown_option_names_and_bad_values_fail_at_decoration(cache: PromptCache) -> None:
    with pytest.raises(TypeError, match="unknown option 'max_token'; the options are: max_tokens, temperature"):
        cache.cached(max_token=5)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="unknown option 'temprature'"):
        cache.cached(**GREEDY)(chat).with_options(temprature=0.0)  # type: ignore[call-arg]
    with pytest.raises(RequestError, match="max_tokens must be at least 1"):
        cache.cached(max_tokens=0)
    with pytest.raises(RequestError, match="cache_salt must be 1 to 256 characters"):
        cache.cached(cache_salt="")


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"max_tokens": "5"}, "option max_tokens='5': Input should be a valid integer"),
        ({"max_tokens": True}, "option max_tokens=True: Input should be a valid integer"),
        ({"temperature": "hot"}, "option temperature='hot': Input should be a valid number"),
        ({"stop": 5}, "option stop=5: Input should be a valid string"),
        ({"cache_salt": 5}, "option cache_salt=5"),
        ({"layout": "no"}, "option layout='no': Input should be a valid boolean"),
    ],
)
def test_an_option_of_the_wrong_type_is_named_at_decoration(
    cache: PromptCache, options: dict[str, Any], says: str
) -> None:
    with pytest.raises(TypeError, match=says):
        cache.cached(**options)
    with pytest.raises(TypeError, match=says):
        cache.cached(**GREEDY)(chat).with_options(**options)


def test_what_is_no_function_or_no_address_is_refused_with_what_to_pass(cache: PromptCache) -> None:
    with pytest.raises(TypeError, match="cached\\(\\) decorates a function that returns a prompt, not int"):
        cache.cached(5)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="takes the server's URL as a string"):
        PromptCache.connect(8000)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout is in seconds and must be more than 0"):
        PromptCache.connect("http://127.0.0.1:8000", timeout=-1)


def test_a_closed_cache_refuses_calls_and_bad_settings_fail_to_open(cache: PromptCache, tmp_path: Path) -> None:
    ask = cache.cached(**GREEDY)(chat)
    cache.close()
    cache.close()
    with pytest.raises(RuntimeError, match="this PromptCache is closed"):
        ask(QUESTION)
    with pytest.raises(ConfigError, match="unknown policy 'newest'"):
        PromptCache.open(model="smollm2-135m", store=tmp_path, policy="newest")


# -- the example --------------------------------------------------------------------------------------------------


@pytest.mark.smollm2
def test_the_question_answering_example_serves_later_questions_from_the_cache_and_leaves_no_folder(
    tmp_path: Path,
) -> None:
    example = REPOSITORY / "examples" / "decorator_qa.py"
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    done = subprocess.run(
        [sys.executable, str(example)],
        cwd=REPOSITORY,
        env={**os.environ, "TMPDIR": str(temporary)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    cached = [int(count) for count in re.findall(r"cached (\d+) of \d+ prompt tokens", done.stdout)]
    assert len(cached) >= 2 and cached[0] == 0 and all(count > 0 for count in cached[1:]), done.stdout
    assert list(temporary.iterdir()) == []  # its temporary store is gone


def test_an_in_process_caches_worker_threads_run_torch_on_one_cpu_thread(cache: PromptCache) -> None:
    # As a server's: the engine prepares prompts and copies blocks there, and a pool of threads made there beside the
    # model thread's would have the model's threads sleep between its kernels.
    assert cache._loop.run(asyncio.to_thread(torch.get_num_threads)) == 1
