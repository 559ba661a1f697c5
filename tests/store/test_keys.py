"""Block keys: chained, namespaced, secret-seeded."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from pathlib import Path

import pytest

from prefixgate.store import BlockKey, chain_keys
from prefixgate.store.keys import load_or_create_secret
from tests.store.conftest import make_namespace

SECRET = bytes(32)


def test_keys_of_a_prefix_are_the_leading_keys_of_the_whole() -> None:
    seed = make_namespace().seed(SECRET)
    whole = chain_keys(seed, list(range(100)), 8)
    assert chain_keys(seed, list(range(40)), 8) == whole[:5]
    assert len(whole) == 12  # 100 tokens hold 12 full blocks of 8


def test_a_changed_token_changes_its_block_and_every_later_key() -> None:
    seed = make_namespace().seed(SECRET)
    tokens = list(range(64))
    changed = [*tokens[:20], 999, *tokens[21:]]
    before, after = chain_keys(seed, tokens, 8), chain_keys(seed, changed, 8)
    assert before[:2] == after[:2]
    assert all(a != b for a, b in zip(before[2:], after[2:], strict=True))


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_fingerprint", "model-b"),
        ("tokenizer_hash", "tok-2"),
        ("dtype", "bfloat16"),
        ("block_shape", (2, 2, 2, 4, 16)),
        ("tenant_salt", "tenant-b"),
        ("format_version", 99),
    ],
)
def test_every_namespace_field_changes_every_key(field: str, value: object) -> None:
    namespace = make_namespace()
    other = replace(namespace, **{field: value})
    tokens = list(range(32))
    keys = set(chain_keys(namespace.seed(SECRET), tokens, 8))
    assert keys.isdisjoint(chain_keys(other.seed(SECRET), tokens, 8))


def test_another_deployment_secret_changes_every_key() -> None:
    namespace = make_namespace()
    tokens = list(range(32))
    keys = set(chain_keys(namespace.seed(SECRET), tokens, 8))
    assert keys.isdisjoint(chain_keys(namespace.seed(b"\x01" * 32), tokens, 8))


def test_limit_caps_the_number_of_keys() -> None:
    assert len(chain_keys(make_namespace().seed(SECRET), list(range(100)), 8, limit=3)) == 3


def test_block_key_round_trips_through_hex_and_rejects_other_text() -> None:
    key = chain_keys(make_namespace().seed(SECRET), list(range(8)), 8)[0]
    assert BlockKey.from_hex(key.hex()) == key
    with pytest.raises(ValueError, match="32 hex digits"):
        BlockKey.from_hex("abcd")


def test_secret_is_created_once_and_kept(tmp_path: Path) -> None:
    first = load_or_create_secret(tmp_path)
    assert load_or_create_secret(tmp_path) == first
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600


def _secret_of(folder: str) -> bytes:
    return load_or_create_secret(Path(folder))


def test_processes_racing_to_create_the_secret_agree(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        secrets = pool.map(_secret_of, [str(tmp_path)] * 8)
    assert len(set(secrets)) == 1
