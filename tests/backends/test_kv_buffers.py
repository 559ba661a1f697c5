"""KV buffers: a prefix fetched into a request's buffer runs in place; buffers grow within it and are reused."""

from __future__ import annotations

import torch

from prefixgate.backends import KVGeometry
from prefixgate.backends.kv_buffers import KVBuffers, KVReservation
from tests.backends.conftest import BackendFactory
from tests.backends.streams import GREEDY, BlockSink, collect
from tests.backends.test_kv_reuse import make_prompt

GEOMETRY = KVGeometry(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)
CPU = torch.device("cpu")
TOKEN_BYTES = 2 * 2 * 2 * 4 * 4  # layers, K and V, kv_heads, head_dim, float32


def fill(buffer: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Write `count` distinct blocks into the buffer's leading positions, as a store's fetch does; return them."""
    size = GEOMETRY.block_size
    slots = [buffer[:, :, :, i * size : (i + 1) * size] for i in range(count)]
    for index, slot in enumerate(slots):
        slot.fill_(float(index + 1))
    return slots


def reserve(buffers: KVBuffers, tokens: int, first: int, released: list[int] | None = None) -> KVReservation:
    """Reserve `tokens` tokens with room for `first` at once; each release appends to `released`."""
    return KVReservation(buffers, tokens, first, lambda _: (released if released is not None else []).append(1))


def test_a_reservation_rounds_up_to_whole_granules_and_counts_their_bytes() -> None:
    reservation = reserve(KVBuffers(GEOMETRY, CPU), 300, 100)
    assert reservation.tokens == 320
    assert reservation.nbytes == 320 * TOKEN_BYTES
    assert reservation.buffer is not None and reservation.buffer.shape == (2, 2, 2, 128, 4)


def test_blocks_fetched_into_the_buffer_stay_in_place_and_others_are_copied() -> None:
    reservation = reserve(KVBuffers(GEOMETRY, CPU), 100, 100)
    buffer = reservation.buffer
    assert buffer is not None
    in_place = fill(buffer, 2)
    elsewhere = [torch.full(GEOMETRY.block_shape, 9.0)]
    reservation.load([*in_place, *elsewhere])  # blocks 0 and 1 where they are, block 2 copied in
    assert torch.equal(buffer[:, :, :, :8], in_place[0]) and float(buffer[0, 0, 0, 8, 0]) == 2.0
    assert torch.equal(buffer[:, :, :, 16:24], elsewhere[0])


def test_a_buffer_grows_keeping_what_it_holds_but_never_past_the_reservation() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    reservation = reserve(buffers, 600, 100)
    small = reservation.buffer
    assert small is not None and small.shape[3] == 128
    blocks = [b.clone() for b in fill(small, 3)]
    grown = reservation.ensure(200, 24)  # doubling gives 256, within the 640 reserved
    assert grown.shape[3] == 256 and reservation.buffer is grown
    assert torch.equal(grown[:, :, :, :24], torch.cat(blocks, dim=3))
    assert reservation.ensure(600, 24).shape[3] == 640  # doubling would give 512, too few: what is needed, rounded
    try:
        reservation.ensure(641, 24)
    except RuntimeError as error:
        assert "reserved 640 tokens" in str(error)
    else:
        raise AssertionError("growth past the reservation must fail")


def test_release_gives_the_buffer_back_once_and_the_next_reservation_reuses_it() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    released: list[int] = []
    first = reserve(buffers, 300, 300, released)
    assert first.buffer is not None
    address = first.buffer.data_ptr()
    first.release()
    first.release()
    assert released == [1] and first.buffer is None
    assert reserve(buffers, 1000, 1000).buffer.data_ptr() != address  # type: ignore[union-attr]  # too small
    assert reserve(buffers, 200, 200).buffer.data_ptr() != address  # type: ignore[union-attr]  # larger than reserved
    assert reserve(buffers, 500, 300).buffer.data_ptr() == address  # type: ignore[union-attr]


def test_only_keep_bytes_of_returned_buffers_are_kept_newest_first() -> None:
    one = 256 * TOKEN_BYTES  # bytes of a 256-token buffer
    buffers = KVBuffers(GEOMETRY, CPU, keep_bytes=2 * one)
    taken = [buffers.take(256, 256) for _ in range(3)]
    addresses = [buffer.data_ptr() for buffer in taken]
    for buffer in taken:
        buffers.give_back(buffer)
    again = {buffers.take(256, 256).data_ptr() for _ in range(2)}
    assert again == set(addresses[1:])


def test_buffers_taken_in_inference_mode_are_ordinary_tensors_a_store_may_write() -> None:
    buffers = KVBuffers(GEOMETRY, CPU)
    with torch.inference_mode():
        buffer = buffers.take(10, 256)
    assert not buffer.is_inference()
    buffer.zero_()


async def test_generation_from_a_prefix_fetched_into_the_reserved_buffer_matches_a_recompute(
    make_backend: BackendFactory,
) -> None:
    backend = make_backend()
    prompt = make_prompt(45)
    sink = BlockSink()
    full = await collect(backend, prompt, on_block=sink)
    reservation = await backend.reserve(len(prompt), 12)
    buffer = reservation.buffer
    assert buffer is not None
    size = backend.geometry.block_size
    views = [buffer[:, :, :, i * size : (i + 1) * size] for i in range(4)]
    for view, block in zip(views, sink.blocks, strict=False):
        view.copy_(block)  # as the store's fetch(out=) does
    tokens = [chunk.token_id async for chunk in backend.generate(prompt, views, GREEDY, reservation=reservation)]
    assert tokens == full.token_ids
    assert backend.admission().running == 0 and backend.admission().bytes_in_use == 0
    again = await backend.reserve(len(prompt), 12)
    assert again.buffer is not None and again.buffer.data_ptr() == buffer.data_ptr()  # already used: reused
    again.release()
