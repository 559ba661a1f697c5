"""The `prefixgate` command line: `prefixgate serve`."""

from __future__ import annotations

import argparse
import errno
import gc
import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from pydantic import ByteSize

from prefixgate import __version__
from prefixgate.errors import ConfigError, PrefixgateError
from prefixgate.proxy.settings import Settings, load_settings

if TYPE_CHECKING:  # imported to serve only: --help, --version and a refused setting answer without the model stack
    import torch
    from aiohttp import web

# Settings whose values are maps take `KEY=VALUE` flags that may repeat.
_MAP_FLAGS = {
    "api_keys": ("--api-key", "KEY=TENANT"),
    "layout_patterns": ("--layout-pattern", "NAME=REGEX"),
    "upstream_api_keys": ("--upstream-api-key", "URL=KEY"),
    "prices": ("--price", "MODEL=IN,CACHED,WRITE,OUT"),
}
# Settings whose values are lists of URLs take a flag that may repeat.
_LIST_FLAGS = {"remote": "repeat --remote for each node of a Redis Cluster", "upstream": "repeat --upstream for more"}
_BYTE_UNITS = ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"), (0, ""))  # byte settings shown as flags take them


def main(argv: list[str] | None = None) -> int:
    """Run the `prefixgate` command."""
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        for name in _MAP_FLAGS:
            overrides[name] = _pairs(overrides.get(name), _MAP_FLAGS[name][0])
        settings = load_settings(args.config, **overrides)
        _configure_logging(settings)
        # Bound before the model loads, so a port in use is said at once, in one line.
        listening = _listen(settings.host, settings.port)
        # Here, not at the top: torch and transformers take seconds to import, which --help and a refusal need not.
        from aiohttp import web

        from prefixgate.proxy.app import SERVE_OPTIONS, build_engine, create_app

        app = create_app(settings, build_engine)
        app.on_startup.append(_freeze_heap)  # after the engine starts: create_app's context is the first handler
        # Printed once the model is loaded and the store open, so it shows what the server really has.
        # access_log=None: the app logs each request itself, with its tenant and tokens (prefixgate.requests).
        web.run_app(
            app,
            sock=listening,
            access_log=None,
            print=lambda _: print(_banner(app, settings), flush=True),
            **SERVE_OPTIONS,
        )
        if _still_compiling(app):
            # Its thread is inside torch, which can abort the interpreter's exit: everything is closed, leave now.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except PrefixgateError as error:
        print(f"prefixgate: {error}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description="A prompt-caching proxy for LLMs.")
    parser.add_argument("--version", action="version", version=f"prefixgate {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP proxy",
        description="Serve the OpenAI-compatible HTTP proxy. Every flag can also be set as a PREFIXGATE_<NAME> "
        "environment variable or a key in the --config TOML file; flags win over variables, variables over the file.",
    )
    serve.add_argument("--config", type=Path, help="TOML file of settings (keys as below, with underscores)")
    for name, field in Settings.model_fields.items():
        help_text = f"{field.description} (default: {_show(field.get_default(call_default_factory=True))})"
        if name in _MAP_FLAGS:
            flag, metavar = _MAP_FLAGS[name]
            help_text += f"; repeat {flag} for more"
            serve.add_argument(flag, dest=name, action="append", metavar=metavar, help=help_text)
        elif name in _LIST_FLAGS:
            help_text += f"; {_LIST_FLAGS[name]}"
            flag = f"--{name.replace('_', '-')}"
            serve.add_argument(flag, dest=name, action="append", metavar="URL", help=help_text)
        elif field.annotation is bool:
            serve.add_argument(
                f"--{name.replace('_', '-')}", dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            in_bytes = field.annotation is ByteSize or ByteSize in get_args(field.annotation)
            flag = f"--{name.replace('_', '-')}"
            serve.add_argument(flag, dest=name, metavar="BYTES" if in_bytes else name.upper(), help=help_text)
    return parser


def _configure_logging(settings: Settings) -> None:
    handler = logging.StreamHandler()
    if settings.log_format == "json":
        handler.setFormatter(_JSONFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)


class _JSONFormatter(logging.Formatter):
    """Format each record as one JSON object: time, level, logger, message, and a request's own fields."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "fields", {}),
        }
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def _banner(app: web.Application, settings: Settings) -> str:
    """Return what the server says when it starts: the model and URL, the store and its tiers, the dashboard."""
    from prefixgate.proxy.serving import ENGINE
    from prefixgate.proxy.upstream_engine import UpstreamEngine

    url = f"http://{settings.host}:{settings.port}"
    engine = app[ENGINE]
    if isinstance(engine, UpstreamEngine):
        upstreams = ", ".join(upstream.url for upstream in engine.pool.router.upstreams)
        return f"prefixgate {__version__} serving {settings.model} on {url}/v1\n  in front of upstreams: {upstreams}"
    tiers = ", ".join(f"{tier.name} {_show(ByteSize(tier.capacity_bytes))}" for tier in engine.store.tiers)
    where = f"in {settings.store}" if settings.store is not None else "in memory only (nothing persists)"
    lines = [
        f"prefixgate {__version__} serving {settings.model} on {url}/v1",
        f"  model in {_dtype(engine.store.device, engine.store.layout.dtype, settings)} on {engine.store.device}",
        f"  steps {_steps(engine.backend.steps)}",
        f"  store {where}: {tiers}",
    ]
    remote = engine.store.remote
    if remote is not None:
        lines.append(f"  remote tier: Redis at {remote.url}, blocks live {remote.ttl:g} s")
    if settings.admin_key is not None:
        lines.append(f"  admin dashboard: {url}/admin/")
    return "\n".join(lines)


async def _freeze_heap(app: web.Application) -> None:
    """Leave the objects that loading the model made, and compiling its step once that ends, out of the garbage
    collector's full passes.

    A full pass walks every object the collector tracks with the GIL held, so the event loop and the model thread both
    stop for it: with the objects a load and a compile leave (about 900,000 for SmolLM2), passes took 300 to 900 ms,
    inside a step or before a first token. Frozen (`gc.freeze`) they are left out, and reference counting still frees
    them; garbage among them is collected first. A large request body's parse later freezes every object alive again
    (see `prefixgate.proxy.body`)."""
    from prefixgate.backends.hf_backend import HFBackend
    from prefixgate.proxy.serving import ENGINE
    from prefixgate.proxy.upstream_engine import UpstreamEngine

    _collect_and_freeze()
    engine = app[ENGINE]
    backend = None if isinstance(engine, UpstreamEngine) else engine.backend
    compiling = backend.compiling if isinstance(backend, HFBackend) else None
    if compiling is not None and compiling.is_alive():
        threading.Thread(target=_freeze_after, args=(compiling,), name="prefixgate-freeze", daemon=True).start()


def _freeze_after(compiling: threading.Thread) -> None:
    compiling.join()
    _collect_and_freeze()


def _collect_and_freeze() -> None:
    gc.collect()
    gc.freeze()


def _still_compiling(app: web.Application) -> bool:
    from prefixgate.proxy.serving import ENGINE
    from prefixgate.proxy.upstream_engine import UpstreamEngine

    engine = app.get(ENGINE)
    return engine is not None and not isinstance(engine, UpstreamEngine) and engine.backend.steps == "compiling"


def _steps(steps: str) -> str:
    """Return how the model's steps run, as the banner says it."""
    if steps == "compiling":
        return "compiling in the background (eager until then; --compile sets it)"
    return f"{steps} (--compile sets it)"


def _dtype(device: torch.device, dtype: torch.dtype, settings: Settings) -> str:
    """Return the model's dtype as the banner names it, with why when `--dtype auto` chose it."""
    from prefixgate.backends.hf_backend import auto_dtype

    name = str(dtype).removeprefix("torch.")
    chosen, why = auto_dtype(device)
    return f"{name} ({why}; --dtype sets it)" if settings.dtype == "auto" and dtype == chosen else name


def _listen(host: str, port: int) -> socket.socket:
    """Return a socket listening on `host:port`, or raise ConfigError saying why it cannot."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as error:
        reason = "it is in use" if error.errno == errno.EADDRINUSE else error.strerror or str(error)
        raise ConfigError(f"cannot listen on {host}:{port}: {reason}; choose another with --port (or --host)") from None


def _pairs(values: list[str] | None, flag: str) -> dict[str, str] | None:
    if not values:
        return None
    pairs = {}
    for value in values:
        key, sep, item = value.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} takes KEY=VALUE, got {value!r}")
        pairs[key] = item
    return pairs


def _show(value: Any) -> str:
    if isinstance(value, dict | list):
        return "none" if not value else ", ".join(value)
    if isinstance(value, ByteSize):  # as a flag takes it: 8GiB, not 8589934592
        return next(f"{value >> shift}{unit}" for shift, unit in _BYTE_UNITS if value % (1 << shift) == 0)
    return "none" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())
