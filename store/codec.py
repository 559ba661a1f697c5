"""The block codec: one bytes value per block, a msgpack header followed by the raw tensor bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import numpy as np
import torch
import xxhash

from prefixgate.errors import StoreError
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep, dtype_from_name
from prefixgate.store.keys import BlockKey

# value = MAGIC | u32 header length | msgpack header | raw tensor bytes
MAGIC = b"PGB1"
_PREFIX = struct.Struct("<4sI")


class CorruptBlockError(StoreError):
    """A stored value cannot be decoded, or its checksum or tokens do not match."""


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a stored value says about its block, readable without touching the tensor bytes."""

    dtype: str
    shape: tuple[int, ...]
    tokens: tuple[int, ...]
    checksum: int
    parent: BlockKey | None
    tenant: str
    created: float
    keep: Keep
    nbytes: int  # of the tensor payload


def encode(block: Block, keep: Keep = BY_POLICY) -> bytes:
    """Return the stored value of `block`."""
    kv = block.kv.detach().contiguous().cpu()
    payload = kv.view(torch.uint8).numpy()
    tokens = np.asarray(block.tokens, dtype=np.uint32).tobytes()
    header = msgpack.packb(
        {
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
            "tokens": tokens,
            "checksum": checksum(tokens, payload.data),
            "parent": block.parent.digest if block.parent is not None else None,
            "tenant": block.tenant,
            "created": block.created,
            "pinned": keep.pinned,
            "ttl": keep.ttl,
            "retain_until": keep.retain_until,
        }
    )
    return b"".join((_PREFIX.pack(MAGIC, len(header)), header, payload.data))


def read_header(value: bytes | memoryview) -> tuple[BlockHeader, int]:
    """Parse the header of a stored value; return it and the offset of the tensor bytes."""
    try:
        magic, length = _PREFIX.unpack_from(value, 0)
        if magic != MAGIC:
            raise CorruptBlockError(f"bad magic {bytes(magic)!r}")
        start = _PREFIX.size
        fields = msgpack.unpackb(value[start : start + length])
        parent = fields["parent"]
        header = BlockHeader(
            dtype=fields["dtype"],
            shape=tuple(fields["shape"]),
            tokens=tuple(np.frombuffer(fields["tokens"], dtype=np.uint32).tolist()),
            checksum=fields["checksum"],
            parent=BlockKey(parent) if parent is not None else None,
            tenant=fields["tenant"],
            created=fields["created"],
            # Values written before retentions existed have none.
            keep=Keep(fields["pinned"], fields["ttl"], fields.get("retain_until")),
            nbytes=len(value) - start - length,
        )
    except CorruptBlockError:
        raise
    except Exception as error:  # any malformed header, whatever msgpack or struct raise for it
        raise CorruptBlockError(f"unreadable header: {error}") from error
    return header, start + length


def decode(
    key: BlockKey, value: bytes | memoryview, layout: BlockLayout, out: torch.Tensor | None = None
) -> tuple[Block, BlockHeader]:
    """Return the verified block stored in `value` (its tensor copied into `out` when given).

    Raise CorruptBlockError when anything does not match.
    """
    header, offset = read_header(value)
    if header.shape != layout.shape or header.dtype != layout.dtype_name:
        raise CorruptBlockError(f"block is {header.shape} {header.dtype}, expected {layout.shape} {layout.dtype_name}")
    payload = memoryview(value)[offset:]
    if len(payload) != layout.nbytes:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, expected {layout.nbytes}")
    if out is None or payload.readonly:
        # The one copy out of a value the tensor cannot use or keep (memory-mapped, or a buffer the caller reuses);
        # the checksum then reads the copy, still in the CPU cache, so memory is read once, not twice. A writable
        # value copied into `out` anyway is checked and copied where it lies.
        payload = memoryview(bytearray(payload))
    tokens = np.asarray(header.tokens, dtype=np.uint32).tobytes()
    if checksum(tokens, payload) != header.checksum:
        raise CorruptBlockError("checksum mismatch")
    data = torch.frombuffer(payload, dtype=torch.uint8)
    kv = data.view(dtype_from_name(header.dtype)).reshape(header.shape)  # kv: [layers, 2, kv_heads, block, head_dim]
    if out is not None:
        kv = out.copy_(kv)
    block = Block(key, header.tokens, kv, parent=header.parent, tenant=header.tenant, created=header.created)
    return block, header


def checksum(tokens: bytes, payload: bytes | bytearray | memoryview) -> int:
    """Return the 64-bit checksum stored with a block over its token ids and tensor bytes."""
    digest = xxhash.xxh3_64(tokens)
    digest.update(payload)
    return digest.intdigest()
