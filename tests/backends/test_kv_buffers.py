"""KV buffers: a prefix fetched into a lent buffer runs in place, once; buffers come back and are reused."""

from __future__ import annotations

import asyncio

import torch

from prefixgate.backends import KVGeometry
from prefixgate.backends.kv_buffers import KVBuffers
from tests.backends.conftest import BackendFactory
from tests.backends.streams import BlockSink, collect
from tests.backends.test_kv_reuse import make_prompt

GEOMETRY = KVGeometry(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)
CPU = torch.device("cpu")


def fill(buffer: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Write `count` distinct blocks into the buffer's leading positions, as a store's fetch does; return them."""
    size = GEOMETRY.block_size
    slots = [buffer[:, :, :, i * size : (i + 1) * size] for i in range(count)]
    for index, slot in enumerate(slots):
        slot.fill_(float(index))
    return slots


def test_blocks_fetched_into_a_lent_buffer_are_adopted_in_place_once() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    lent = buffers.lend(100)
    assert lent.shape == (2, 2, 2, 256, 4)  # capacities are whole multiples of 256 tokens
    blocks = fill(lent, 3)
    adopted = buffers.adopt_or_take(blocks, 100)
    assert adopted is lent
    again = buffers.adopt_or_take(blocks, 100)  # a second reader of the same blocks gets its own copy
    assert again.data_ptr() != lent.data_ptr()
    assert torch.equal(again[:, :, :, :24], lent[:, :, :, :24])


def test_blocks_that_are_not_the_leading_slices_of_a_lent_buffer_are_copied() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    lent = buffers.lend(100)
    blocks = fill(lent, 3)
    for others in (blocks[1:], [blocks[0], blocks[2]], [block.clone() for block in blocks]):
        taken = buffers.adopt_or_take(others, 100)
        assert taken.data_ptr() != lent.data_ptr()
        for index, block in enumerate(others):
            assert torch.equal(taken[:, :, :, index * 8 : (index + 1) * 8], block)


def test_a_returned_buffer_serves_the_next_request_that_fits() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    first = buffers.adopt_or_take([], 300)
    address = first.data_ptr()
    buffers.give_back(first)
    assert buffers.lend(1000).data_ptr() != address  # too small for it
    assert buffers.lend(500).data_ptr() == address


def test_only_keep_bytes_of_returned_buffers_are_kept_newest_first() -> None:
    one = 2 * 2 * 2 * 256 * 4 * 4  # bytes of a 256-token buffer
    buffers = KVBuffers(GEOMETRY, CPU, keep_bytes=2 * one)
    taken = [buffers.lend(256) for _ in range(3)]
    addresses = [buffer.data_ptr() for buffer in taken]
    for buffer in taken:
        buffers.give_back(buffer)
    again = {buffers.lend(256).data_ptr() for _ in range(2)}
    assert again == set(addresses[1:])


def test_buffers_taken_in_inference_mode_are_ordinary_tensors_a_store_may_write() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    with torch.inference_mode():
        buffer = buffers.adopt_or_take([], 10)
    assert not buffer.is_inference()
    buffer.zero_()


async def test_generation_from_a_prefix_fetched_into_a_lent_buffer_matches_a_recompute(
    make_backend: BackendFactory,
) -> None:
    backend = make_backend()
    prompt = make_prompt(45)
    sink = BlockSink()
    full = await collect(backend, prompt, on_block=sink)
    lent = backend.kv_buffer(len(prompt), 8)
    assert lent is not None
    size = backend.geometry.block_size
    views = [lent[:, :, :, i * size : (i + 1) * size] for i in range(4)]
    for view, block in zip(views, sink.blocks, strict=False):
        view.copy_(block)  # as the store's fetch(out=) does
    assert (await collect(backend, prompt, views)).token_ids == full.token_ids
    assert backend.kv_buffer(len(prompt), 8) is lent  # its job over, the buffer is lent again, already used
    # Two requests handed the same in-place blocks at once: one runs in the buffer, the other in a copy.
    results = await asyncio.gather(collect(backend, prompt, views), collect(backend, prompt, views))
    assert [result.token_ids for result in results] == [full.token_ids] * 2
