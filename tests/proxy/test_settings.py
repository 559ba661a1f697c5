"""Settings: flags over environment over file over defaults, validated with messages that say what to change."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate import __version__
from prefixgate.backends import HFBackend, model_runner
from prefixgate.backends.hf_backend import auto_dtype
from prefixgate.errors import ConfigError
from prefixgate.proxy.app import build_engine
from prefixgate.proxy.cli import _banner, _freeze_heap, _JSONFormatter, main
from prefixgate.proxy.serving import ENGINE, SETTINGS
from prefixgate.proxy.settings import load_settings
from tests.proxy.conftest import HANG_GUARD_SECONDS, MODEL, Serve, tiny_engine

CONFIG = """
store = "/var/lib/prefixgate"
host_budget = "16GiB"
policy = "lru+ttl"
idle_ttl = 86400
port = 9000
api_keys = { "sk-team-a" = "team-a", "sk-team-b" = "team-b" }
"""


def test_defaults_serve_the_embedded_model_on_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith("PREFIXGATE_")]:
        monkeypatch.delenv(name)
    settings = load_settings()
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8000, "smollm2-135m")
    assert settings.api_keys == {} and settings.admin_key is None


def test_flags_win_over_environment_which_wins_over_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "prefixgate.toml"
    config.write_text(CONFIG)
    from_file = load_settings(config)
    assert from_file.store == Path("/var/lib/prefixgate") and from_file.host_budget == 16 << 30
    assert from_file.api_keys == {"sk-team-a": "team-a", "sk-team-b": "team-b"}
    assert (from_file.policy, from_file.idle_ttl, from_file.port) == ("lru+ttl", 86400, 9000)
    monkeypatch.setenv("PREFIXGATE_PORT", "9100")
    monkeypatch.setenv("PREFIXGATE_HOST_BUDGET", "1GiB")
    from_env = load_settings(config)
    assert (from_env.port, from_env.host_budget, from_env.policy) == (9100, 1 << 30, "lru+ttl")
    assert load_settings(config, port="9200").port == 9200


def test_keys_come_from_the_environment_and_help_says_to_keep_them_off_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PREFIXGATE_API_KEYS", '{"sk-team-a": "team-a"}')
    monkeypatch.setenv("PREFIXGATE_ADMIN_KEY", "sk-admin")
    settings = load_settings()
    assert settings.api_keys == {"sk-team-a": "team-a"} and settings.admin_key == "sk-admin"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "prefer PREFIXGATE_API_KEYS" in help_text and "prefer PREFIXGATE_ADMIN_KEY" in help_text


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"port": "0"}, "port"),
        ({"policy": "lfu"}, "choose one of: fifo, lru, lru+ttl, ttl"),
        ({"host_budget": "lots"}, "host_budget"),
        ({"block_size": "-4"}, "block_size"),
        ({"ttl": "0"}, "ttl"),
        ({"dtype": "int3"}, "dtype"),
        ({"frobnicate": "1"}, "frobnicate"),
    ],
)
def test_bad_settings_name_themselves(overrides: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match="bad settings") as error:
        load_settings(**overrides)
    assert words in str(error.value)


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_the_cli_reports_bad_settings_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--policy", "lfu"]) == 2
    assert "unknown policy 'lfu'" in capsys.readouterr().err
    assert main(["serve", "--api-key", "no-equals-sign"]) == 2
    assert "--api-key takes KEY=VALUE" in capsys.readouterr().err


def test_the_cli_help_documents_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    flags = ("--host-budget", "--kv-buffer-budget", "--api-key", "--admin-key", "--layout-pattern", "--no-layout")
    for flag in (*flags, "--config"):
        assert flag in text
    words = " ".join(text.split())
    assert "--host-budget BYTES host (CPU memory) tier bytes (default: 8GiB)" in words
    assert "(default: 16MiB)" in words and "8589934592" not in words
    assert "repeat --api-key for more" in words and "repeat --layout-pattern for more" in words
    assert "--remote URL" in words and "repeat --remote for each node of a Redis Cluster" in words
    assert "--remote-queue-budget BYTES" in words and "(default: 256MiB)" in words


def test_help_version_and_refusals_never_import_the_model_stack() -> None:
    # In a fresh interpreter, as `prefixgate` starts: torch and transformers take seconds to import, and are imported
    # only to serve (the command line answers in a fraction of a second).
    script = (
        "import sys\nfrom prefixgate.proxy import cli\n"
        "for argv in (['--help'], ['--version'], ['serve', '--help'], ['serve', '--port', '99999'],"
        " ['serve', '--remote', 'http://x'], ['serve', '--config', 'missing.toml']):\n"
        "    try:\n        print('exit', cli.main(argv))\n"
        "    except SystemExit as stop:\n        print('exit', stop.code)\n"
        "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert [line for line in lines if line.startswith("exit")] == ["exit 0"] * 3 + ["exit 2"] * 3, result.stderr
    assert lines[-1] == "[]", result.stdout


def test_a_malformed_config_file_is_one_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "prefixgate.toml"
    config.write_text("port = \n")
    with pytest.raises(ConfigError, match=r"is not valid TOML: Invalid value \(at line 1"):
        load_settings(config)


def test_a_map_setting_in_the_environment_must_be_json_and_the_error_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXGATE_API_KEYS", "sk-team-a=team-a")
    with pytest.raises(ConfigError, match=r"PREFIXGATE_API_KEYS must be a JSON object, e.g. PREFIXGATE_API_KEYS="):
        load_settings()


def test_a_port_in_use_is_reported_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--store", ""]) == 2
    assert capsys.readouterr().err.strip() == (
        f"prefixgate: cannot listen on 127.0.0.1:{port}: it is in use; choose another with --port (or --host)"
    )


async def test_the_start_banner_names_the_store_its_tiers_and_the_dashboard(serve: Serve, tmp_path: Path) -> None:
    client = await serve(host_budget="256MiB", disk_budget="1GiB", admin_key="sk-admin")
    settings = client.app[SETTINGS]
    # The tiny model is built in float32; the banner says why only where float32 is also what auto chooses here.
    chosen, why = auto_dtype(torch.device("cpu"))
    reason = f" ({why}; --dtype sets it)" if chosen == torch.float32 else ""
    assert _banner(client.app, settings).splitlines() == [
        f"prefixgate {__version__} serving {MODEL} on http://127.0.0.1:8000/v1",
        f"  model in float32{reason} on cpu",
        "  steps eager (--compile sets it)",
        f"  store in {tmp_path / 'store'}: host 256MiB, disk 1GiB",
        "  admin dashboard: http://127.0.0.1:8000/admin/",
    ]
    in_memory = await serve(store="", host_budget="64MiB")
    assert _banner(in_memory.app, in_memory.app[SETTINGS]).splitlines()[3:] == [
        "  store in memory only (nothing persists): host 64MiB"
    ]


def test_json_log_lines_carry_a_request_s_fields() -> None:
    record = logging.LogRecord("prefixgate.requests", logging.INFO, __file__, 1, "request_id=r-1 status=200", (), None)
    record.fields = {"request_id": "r-1", "tenant": None, "status": 200, "cached_tokens": 64}
    line = json.loads(_JSONFormatter().format(record))
    assert line["level"] == "info" and line["logger"] == "prefixgate.requests"
    assert line["message"] == "request_id=r-1 status=200"
    assert (line["request_id"], line["tenant"], line["status"], line["cached_tokens"]) == ("r-1", None, 200, 64)
    assert load_settings(log_format="json", log_level="debug").log_format == "json"
    with pytest.raises(ConfigError, match="log_format"):
        load_settings(log_format="xml")


def test_prices_come_as_four_numbers_or_a_table_and_are_checked() -> None:
    assert load_settings(prices={"m": "0.15, 0.075,0.1875,0.6"}).prices["m"].cached_input == 0.075
    table = {"input": 3, "cached_input": 0.3, "cache_write": 3.75, "output": 15}
    assert load_settings(prices={"m": table}).prices["m"].output == 15
    with pytest.raises(ConfigError, match="four numbers per million tokens"):
        load_settings(prices={"m": "1,2"})
    with pytest.raises(ConfigError, match="prices"):
        load_settings(prices={"m": "1,2,3,-4"})


class _Node:
    """An object the garbage collector tracks."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _collector_walks(node: _Node) -> bool:
    return any(item is node for item in gc.get_objects())


async def test_compile_wait_gives_the_engine_only_once_its_step_has_compiled(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    released, waiting = threading.Event(), threading.Event()

    def held(function: Any, **options: Any) -> Any:
        assert released.wait(HANG_GUARD_SECONDS), "the test never let the compile end"
        raise RuntimeError("no compiler here")  # the compile ends: the steps stay eager

    def wait_compiled(backend: HFBackend) -> None:
        waiting.set()
        wait_for_the_compile(backend)

    wait_for_the_compile = HFBackend.wait_compiled
    monkeypatch.setattr(model_runner.torch, "compile", held)
    monkeypatch.setattr(HFBackend, "wait_compiled", wait_compiled)
    folder = tmp_path / "tiny"
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = load_settings(model=str(folder), compile="on", compile_wait=True, store=None)
    building = asyncio.ensure_future(build_engine(settings))
    waits = asyncio.ensure_future(asyncio.to_thread(waiting.wait, HANG_GUARD_SECONDS))
    await asyncio.wait({building, waits}, return_when=asyncio.FIRST_COMPLETED)
    assert not building.done() and await waits  # it waits for the compile, which is held
    released.set()
    engine = await building
    try:
        assert engine.backend.steps == "eager"  # the compile ended (refused) before the engine came
    finally:
        await engine.close()


async def test_the_server_leaves_what_loading_and_compiling_made_out_of_full_collections(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, llama: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled = threading.Event()  # the compile ends (refused) when the test says so

    def held(function: Any, **options: Any) -> Any:
        assert compiled.wait(HANG_GUARD_SECONDS), "the test never let the compile end"
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(model_runner.torch, "compile", held)
    engine = tiny_engine(load_settings(store=tmp_path / "store", model=MODEL), tokenizer, llama, [], compile_steps=True)
    app = web.Application()
    app[ENGINE] = engine
    try:
        loaded, cycle = _Node(), _Node()
        cycle.other = cycle  # garbage only the collector finds
        gone = weakref.ref(cycle)
        del cycle
        await _freeze_heap(app)
        assert gone() is None  # garbage was collected before the rest was frozen, not kept for good
        assert not _collector_walks(loaded)
        made_while_compiling = _Node()
        assert _collector_walks(made_while_compiling)
        compiled.set()
        [freezing] = [thread for thread in threading.enumerate() if thread.name == "prefixgate-freeze"]
        freezing.join(HANG_GUARD_SECONDS)
        assert engine.backend.steps == "eager" and not freezing.is_alive()
        assert not _collector_walks(made_while_compiling)
    finally:
        compiled.set()
        gc.unfreeze()
        await engine.close()
