"""The block codec: a msgpack header and raw tensor bytes, verified on decode."""

from __future__ import annotations

import pytest
import torch

from prefixgate.store import Block, BlockKey, BlockLayout, Keep
from prefixgate.store.codec import CorruptBlockError, decode, encode, read_header

KEY = BlockKey(bytes(range(16)))
PARENT = BlockKey(bytes(range(1, 17)))


def make_block(dtype: torch.dtype) -> tuple[Block, BlockLayout]:
    layout = BlockLayout((3, 2, 2, 4, 8), dtype)
    kv = torch.randn(layout.shape).to(dtype)  # kv: [3, 2, 2, 4, 8]
    return Block(KEY, (1, 2, 3, 70000), kv, parent=PARENT, tenant="acme", created=12.5), layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_returns_exactly_what_was_encoded(dtype: torch.dtype) -> None:
    block, layout = make_block(dtype)
    decoded, header = decode(KEY, encode(block, Keep(pinned=True, ttl=30.0, retain_until=5.0)), layout)
    assert torch.equal(decoded.kv, block.kv)
    assert decoded.kv.dtype == dtype
    assert (decoded.tokens, decoded.parent, decoded.tenant, decoded.created) == ((1, 2, 3, 70000), PARENT, "acme", 12.5)
    assert (header.keep, header.nbytes) == (Keep(pinned=True, ttl=30.0, retain_until=5.0), layout.nbytes)


def test_a_flipped_payload_byte_fails_the_checksum() -> None:
    block, layout = make_block(torch.float32)
    value = bytearray(encode(block))
    value[-5] ^= 0x40
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode(KEY, bytes(value), layout)


@pytest.mark.parametrize(
    "damage",
    [
        lambda value: b"XXXX" + value[4:],  # bad magic
        lambda value: value[:20],  # truncated header
        lambda value: value[:-1],  # truncated payload
        lambda value: value[:8] + b"\xc1" * 40 + value[48:],  # garbage header
    ],
)
def test_damaged_values_raise_corrupt_block_error(damage: object) -> None:
    block, layout = make_block(torch.float32)
    with pytest.raises(CorruptBlockError):
        decode(KEY, damage(encode(block)), layout)  # type: ignore[operator]


def test_a_block_of_another_layout_is_refused() -> None:
    block, _ = make_block(torch.float32)
    with pytest.raises(CorruptBlockError, match="expected"):
        decode(KEY, encode(block), BlockLayout((3, 2, 2, 4, 8), torch.bfloat16))


def test_header_reads_without_the_payload() -> None:
    block, layout = make_block(torch.float32)
    value = encode(block)
    header, offset = read_header(value)
    assert header.tokens == block.tokens
    assert len(value) - offset == layout.nbytes
