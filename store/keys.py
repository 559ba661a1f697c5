"""Block keys: chained 128-bit xxHash over token blocks, seeded by the namespace and a per-deployment secret."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import xxhash

from prefixgate.errors import StoreError

# Bumped whenever the stored block format changes, so old blocks fall out of every namespace.
FORMAT_VERSION = 1
SECRET_FILE = "secret"
assert array("I").itemsize == 4, "token ids are hashed as 32-bit integers"
_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The identity of one block: a 16-byte digest of its namespace and every token up to its end."""

    digest: bytes

    def __post_init__(self) -> None:
        assert len(self.digest) == 16, "block keys are 128-bit digests"

    def hex(self) -> str:
        """Return the key as 32 lowercase hex digits."""
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        """Parse a key written by `hex()`; raise ValueError on anything else."""
        raw = bytes.fromhex(text)
        if len(raw) != 16:
            raise ValueError(f"a block key is 32 hex digits, got {len(text)} characters")
        return cls(raw)

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()})"


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes KV values; KV computed under one namespace is never served under another."""

    model_fingerprint: str
    tokenizer_hash: str
    dtype: str
    block_shape: tuple[int, ...]  # [layers, 2, kv_heads, block_size, head_dim]
    tenant_salt: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def block_size(self) -> int:
        """Return the number of tokens one block covers."""
        return self.block_shape[3]

    def digest(self) -> bytes:
        """Return a 16-byte digest of every field."""
        fields = [
            self.model_fingerprint,
            self.tokenizer_hash,
            self.dtype,
            list(self.block_shape),
            self.tenant_salt,
            self.format_version,
        ]
        return xxhash.xxh3_128_digest(msgpack.packb(fields))

    def seed(self, secret: bytes) -> bytes:
        """Return the chain seed `key_0` for this namespace under a deployment secret."""
        # A keyed cryptographic hash here (not xxHash) so that knowing the namespace fields is not enough to
        # forge keys of another deployment; the per-block chain after it only needs speed.
        return hashlib.blake2b(self.digest(), key=secret, digest_size=16).digest()


def chain_keys(seed: bytes, tokens: Sequence[int], block_size: int, *, limit: int | None = None) -> list[BlockKey]:
    """Return `key_i = H(key_{i-1}, tokens_i)` for every full block of `tokens` (at most `limit` of them)."""
    if block_size <= 0:
        raise RuntimeError(f"block_size must be positive, got {block_size}")
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    # One conversion of the whole prompt to bytes, then one hash call per block. array() converts a list of ints
    # three times faster than numpy does, and the conversion is most of the cost.
    raw = array("I", tokens[: count * block_size]).tobytes()
    step = block_size * 4
    keys: list[BlockKey] = []
    previous = seed
    for start in range(0, count * step, step):
        previous = xxhash.xxh3_128_digest(previous + raw[start : start + step])
        keys.append(BlockKey(previous))
    return keys


def tail_key(parent: BlockKey, tokens: Sequence[int]) -> BlockKey:
    """Return the key of a tail: the fewer than `block_size` tokens that end a sequence after block `parent`.

    Apart from every chain key (a tail's bytes start with a marker), and unique to its parent and tokens: a tail is
    found by its parent and compared token by token, never looked up by key.
    """
    return BlockKey(xxhash.xxh3_128_digest(b"tail" + parent.digest + array("I", tokens).tobytes()))


def load_or_create_secret(folder: Path) -> bytes:
    """Return the deployment secret kept in `folder`, creating it once; safe when processes race."""
    path = folder / SECRET_FILE
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # the store holds every tenant's prompts
    temporary = folder / f".{SECRET_FILE}.{os.getpid()}.{os.urandom(4).hex()}"
    # Created readable by its owner alone, never for a moment by anyone else.
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
        file.write(os.urandom(_SECRET_BYTES))
    try:
        # link() fails when another process won the race; then everyone reads the winner's secret.
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    secret = path.read_bytes()
    if len(secret) != _SECRET_BYTES:
        raise StoreError(f"{path} is damaged ({len(secret)} bytes, expected {_SECRET_BYTES}); delete it to reset")
    return secret


def shared_prefix(first: Sequence[object], second: Sequence[object]) -> int:
    """Return how many leading items (token ids, characters) two sequences share."""
    shared = 0
    for mine, theirs in zip(first, second, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared
