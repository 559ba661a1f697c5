"""On a GPU: a store with its device tier in GPU memory and a pinned host tier keeps every block's values through
puts, fetches into a device buffer, promotions and demotions. Skipped without CUDA; `benchmarks/gpu_check.sh` runs
them where there is one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from prefixgate.store import Block, TieredStore
from prefixgate.store.memory_tier import MemoryTier
from tests.store.conftest import BLOCK, LAYOUT, FakeClock, config, make_blocks, make_namespace

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU = torch.device("cuda")
NS = make_namespace()
PROMPT = list(range(100, 124))  # 6 blocks of 4 tokens; a fetch may reuse the first 5


def open_gpu_store(folder: Path, clock: FakeClock) -> TieredStore:
    """Open a store for a model on the GPU: a device tier of 2 blocks, a host tier of 8, and a disk tier."""
    return TieredStore.open(folder, LAYOUT, config(device=2 * BLOCK, host=8 * BLOCK), device=GPU, clock=clock)


def on_gpu(blocks: list[Block]) -> list[Block]:
    """Return the blocks as a backend hands them over: their tensors in GPU memory."""
    return [replace(block, kv=block.kv.to(GPU)) for block in blocks]


def gpu_buffer() -> torch.Tensor:
    """Return a backend's KV buffer on the GPU, room for 10 blocks, filled with -1."""
    layers, two, heads, _, head_dim = LAYOUT.shape
    return torch.full((layers, two, heads, 40, head_dim), -1.0, device=GPU)  # [layers, 2, kv_heads, 40, head_dim]


def assert_holds(out: torch.Tensor, blocks: list[Block]) -> None:
    """Check that the leading positions of `out` hold the blocks' values, one block after another, and no more."""
    size = LAYOUT.block_size
    for index, block in enumerate(blocks):
        assert torch.equal(out[:, :, :, index * size : (index + 1) * size].cpu(), block.kv), f"block {index} differs"
    assert bool((out[:, :, :, len(blocks) * size :] == -1.0).all())


def pinned_by_allocator() -> int:
    """Return the bytes PyTorch's pinned-memory allocator holds (0 where this PyTorch does not report them)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return int(stats().get("allocated_bytes.current", 0)) if stats is not None else 0


def test_a_gpu_store_pins_its_host_tier_where_it_lies_and_never_its_device_tier(
    tmp_path: Path, clock: FakeClock
) -> None:
    before = pinned_by_allocator()
    store = open_gpu_store(tmp_path, clock)
    device, host, _ = store.tiers
    assert isinstance(device, MemoryTier) and isinstance(host, MemoryTier)
    assert device._pool.is_cuda and host._pool.device.type == "cpu"
    assert host._pool.is_pinned()
    # Registered in place: PyTorch's pinned allocator, which rounds up to a power of two, holds nothing for it.
    assert pinned_by_allocator() == before
    store.close()
    assert not host._pool.is_pinned()  # unregistered on close


def test_blocks_keep_their_values_through_fetches_promotions_and_demotions_on_a_gpu(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_gpu_store(tmp_path, clock) as store:
        blocks = make_blocks(store, PROMPT)[:5]  # their tensors stay on the CPU: what each block must hold
        store.put(on_gpu(blocks))  # five blocks: too many for the device tier, so into the pinned host tier
        assert store.lookup(NS, PROMPT).tiers == ("host",) * 5

        out = gpu_buffer()
        hit = store.fetch(NS, PROMPT, out)  # host to GPU, asynchronously from pinned memory
        assert hit.tiers == ("host",) * 5
        assert_holds(out, blocks)
        # Each block was promoted to the device tier, which kept the last two and demoted the others back.
        assert store.lookup(NS, PROMPT).tiers == ("host", "host", "host", "device", "device")
        device, host, _ = store.stats()
        assert (host.promotions, device.demotions, device.evictions) == (5, 3, 0)

        again = gpu_buffer()
        assert store.fetch(NS, PROMPT, again).cached_tokens == 20  # blocks that went GPU to host and back
        assert_holds(again, blocks)

        store.wait_for_writes()
        store.flush("device")
        store.flush("host")
        from_disk = gpu_buffer()
        assert store.fetch(NS, PROMPT, from_disk).tiers == ("disk",) * 5
        assert_holds(from_disk, blocks)
        assert store.lookup(NS, PROMPT).tiers == ("host", "host", "host", "device", "device")

        fresh = store.fetch(NS, PROMPT)  # into a tensor the store allocates on the GPU
        assert all(block.kv.is_cuda for block in fresh.blocks)
        assert all(torch.equal(got.kv.cpu(), block.kv) for got, block in zip(fresh.blocks, blocks, strict=True))
