"""The Python face: a `PromptCache` whose `cached` decorator sends what a function returns through prefixgate.

The engine is async; a PromptCache runs it (or the HTTP session to a server) on an event loop in a thread of its
own, so plain synchronous code can call it, and so can async code running in any other loop.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, Unpack, overload

from prefixgate.errors import ConfigError
from prefixgate.proxy.engine import Engine, PromptRequest
from prefixgate.proxy.python.decorator import (
    AsyncCachedFunction,
    CachedFunction,
    GenerationOptions,
    Options,
    Prompt,
    resolve_options,
)
from prefixgate.proxy.python.reply import AsyncReplyStream, Pieces, Reply, ReplyStream
from prefixgate.proxy.python.targets import EngineTarget, ServerTarget, Target
from prefixgate.threads import io_threads

P = ParamSpec("P")
_T = TypeVar("_T")


class PromptCache:
    """Send prompts built by Python functions through prefixgate's cache and model, in process or on a server.

    Make one with `open` (a model and a store folder), `connect` (a running server) or `from_engine`; close it
    with `close()` or a `with` block.
    """

    def __init__(self, target: Target, loop: _LoopThread) -> None:
        self._target = target
        self._loop = loop
        if isinstance(target, EngineTarget):
            loop.run(_io_threads())  # the model is loaded
        _OPEN.add(self)

    # -- making one ---------------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        model: str | None = None,
        store: str | Path | None = None,
        *,
        config_file: Path | None = None,
        **settings: Any,
    ) -> PromptCache:
        """Load a model and open the store folder in this process, as `prefixgate serve` would with these settings.

        `settings` are the server's (`block_size`, `host_budget`, `policy`, ...); unset ones come from
        `PREFIXGATE_*` variables, then `config_file`, then the defaults. `store=""` keeps the cache in memory only.
        The model's steps run eagerly unless a `compile` setting says otherwise (here, a variable or the file): a
        script tends to end before compiling them pays, and a process that ends while they compile can abort on its way
        out.
        """
        # Imported here: the app module pulls in the HTTP server, which a connect()-only user never needs.
        from prefixgate.proxy.app import build_engine
        from prefixgate.proxy.settings import load_settings

        loaded = load_settings(config_file, model=model, store=store, **settings)
        if "compile" not in loaded.model_fields_set:
            loaded = loaded.model_copy(update={"compile": "off"})
        loop = _LoopThread()
        try:
            engine = loop.run(build_engine(loaded))
            if not isinstance(engine, Engine):
                loop.run(engine.close())
                raise ConfigError(
                    "PromptCache.open runs a model in this process; for a server in front of upstreams, start "
                    "`prefixgate serve --upstream ...` and use PromptCache.connect(url)"
                )
        except BaseException:
            loop.stop()
            raise
        return cls(EngineTarget(engine), loop)

    @classmethod
    def connect(
        cls, url: str, *, api_key: str | None = None, model: str | None = None, timeout: float | None = 600.0
    ) -> PromptCache:
        """Talk to the prefixgate server at `url` instead; with no `model`, use the one it serves."""
        loop = _LoopThread()
        try:
            target = loop.run(ServerTarget.connect(url, api_key=api_key, model=model, timeout=timeout))
        except BaseException:
            loop.stop()
            raise
        return cls(target, loop)

    @classmethod
    def from_engine(cls, engine: Engine) -> PromptCache:
        """Run an engine that is already built; the cache owns it from now on and closes it on `close()`."""
        return cls(EngineTarget(engine), _LoopThread())

    @property
    def engine(self) -> Engine | None:
        """Return the in-process engine (for its statistics and store), or None when talking to a server."""
        return self._target.engine if isinstance(self._target, EngineTarget) else None

    # -- the decorator ------------------------------------------------------------------------------------------

    @overload
    def cached(self, function: Callable[P, Awaitable[Prompt]], /) -> AsyncCachedFunction[P]: ...
    @overload
    def cached(self, function: Callable[P, Prompt], /) -> CachedFunction[P]: ...
    @overload
    def cached(self, function: None = None, /, **options: Unpack[Options]) -> _Decorator: ...
    def cached(
        self, function: Callable[P, Any] | None = None, /, **options: Unpack[Options]
    ) -> CachedFunction[P] | AsyncCachedFunction[P] | _Decorator:
        """Decorate a function that returns chat messages or a prompt string: calling it returns the model's Reply.

        Options (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, `cache_salt`, `layout`) apply to
        every call; `fn.with_options(...)` overrides some for one call. An `async def` function gives awaitables.
        """
        decorator = _Decorator(self, resolve_options(**options))
        return decorator if function is None else decorator(function)

    # -- sending engine requests directly (what decorated functions call) ----------------------------------------

    def reply(self, request: PromptRequest) -> Reply:
        """Run a request to the end, blocking this thread."""
        return self._loop.run(self._target.complete(request))

    async def areply(self, request: PromptRequest) -> Reply:
        """Run a request to the end without blocking the caller's event loop."""
        return await asyncio.wrap_future(self._loop.submit(self._target.complete(request)))

    def stream(self, request: PromptRequest) -> ReplyStream:
        """Return an iterator over the request's text as it is generated."""
        return ReplyStream(self._loop.loop, self._target.stream(request))

    def astream(self, request: Callable[[], Awaitable[PromptRequest]]) -> AsyncReplyStream:
        """Return an async iterator over the text of the request that `request()` builds when iteration starts."""

        async def open_pieces() -> Pieces:
            return self._target.stream(await request())

        return AsyncReplyStream(self._loop.loop, open_pieces)

    # -- closing ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the model (or close the HTTP session) and the cache's event loop thread; safe to call twice."""
        _OPEN.discard(self)
        if self._loop.running:
            try:
                self._loop.run(self._target.close())
            finally:
                self._loop.stop()

    async def aclose(self) -> None:
        """Close from async code, without blocking the caller's event loop."""
        await asyncio.to_thread(self.close)

    def __enter__(self) -> PromptCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> PromptCache:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class _Decorator:
    """What `cache.cached(**options)` returns: apply it to a function."""

    def __init__(self, cache: PromptCache, options: GenerationOptions) -> None:
        self._cache = cache
        self._options = options

    @overload
    def __call__(self, function: Callable[P, Awaitable[Prompt]], /) -> AsyncCachedFunction[P]: ...
    @overload
    def __call__(self, function: Callable[P, Prompt], /) -> CachedFunction[P]: ...
    def __call__(self, function: Callable[P, Any], /) -> CachedFunction[P] | AsyncCachedFunction[P]:
        if not callable(function):
            raise TypeError(f"cached() decorates a function that returns a prompt, not {type(function).__name__}")
        if inspect.iscoroutinefunction(function):
            return AsyncCachedFunction(self._cache, function, self._options)
        return CachedFunction(self._cache, function, self._options)


_OPEN: weakref.WeakSet[PromptCache] = weakref.WeakSet()


@atexit.register
def _flush_open_caches() -> None:
    # An application that never calls close() still gets the blocks it computed onto disk: the writer threads are
    # daemons, whose unfinished work would vanish at exit. A full close() cannot run this late (the executors it
    # needs are already shut down), and need not: the process is ending.
    for cache in list(_OPEN):
        cache._target.flush()


async def _io_threads() -> None:
    io_threads(asyncio.get_running_loop())


class _LoopThread:
    """An event loop running in a daemon thread: the engine lives here, whichever thread or loop calls it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="prefixgate-prompt-cache", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Return whether the loop still takes work."""
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Schedule a coroutine on the loop; return its concurrent future."""
        if not self.running:
            coroutine.close()  # never scheduled: close it so Python does not warn that it was never awaited
            raise RuntimeError("this PromptCache is closed; open a new one")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run a coroutine on the loop and wait for its result in this thread."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a synchronous PromptCache call cannot run on the cache's own loop; await it instead")
        return self.submit(coroutine).result()

    def stop(self) -> None:
        """Cancel what is left, close open streams, stop the loop and wait for the thread."""
        if self.running:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def _shutdown(self) -> None:
        current = asyncio.current_task()
        tasks = [task for task in asyncio.all_tasks() if task is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()
