"""Builders and fixtures for store tests: a small block layout, blocks with recognisable contents, stores."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from prefixgate.store import Block, BlockLayout, Namespace, StoreConfig, TierConfig, TieredStore, chain_keys
from prefixgate.store.block import SlotOrder
from tests.fake_clock import FakeClock

LAYOUT = BlockLayout(shape=(2, 2, 2, 4, 8), dtype=torch.float32)  # 4 tokens a block, 512 bytes
BLOCK = LAYOUT.nbytes


def make_namespace(tenant: str = "", model: str = "model-a") -> Namespace:
    """Return a namespace for LAYOUT blocks."""
    return Namespace(
        model_fingerprint=model,
        tokenizer_hash="tok",
        dtype=LAYOUT.dtype_name,
        block_shape=LAYOUT.shape,
        tenant_salt=tenant,
    )


def make_kv(seed: int) -> torch.Tensor:
    """Return a block tensor whose contents depend on `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape, generator=generator, dtype=LAYOUT.dtype)  # kv: [2, 2, 2, 4, 8]


def make_blocks(store: TieredStore, tokens: Sequence[int], namespace: Namespace | None = None) -> list[Block]:
    """Return every full block of `tokens` under `namespace`, keyed as the store keys them."""
    namespace = namespace or make_namespace()
    size = LAYOUT.block_size
    keys = chain_keys(store.seed(namespace), tokens, size)
    return [
        Block(
            key,
            tuple(tokens[i * size : (i + 1) * size]),
            make_kv(int.from_bytes(key.digest[:4], "little")),
            parent=keys[i - 1] if i else None,
            tenant=namespace.tenant_salt,
        )
        for i, key in enumerate(keys)
    ]


def config(device: int = 0, host: int = 8 * BLOCK, disk: int = 64 * BLOCK, **policy: object) -> StoreConfig:
    """Return a store config with budgets counted in bytes."""
    return StoreConfig(
        device=TierConfig(device, **policy),  # type: ignore[arg-type]
        host=TierConfig(host, **policy),  # type: ignore[arg-type]
        disk=TierConfig(disk, **policy),  # type: ignore[arg-type]
    )


StoreFactory = Callable[..., TieredStore]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def open_store(tmp_path: Path, clock: FakeClock) -> Iterator[StoreFactory]:
    """Open stores in a temporary folder (the same one each call, so reopening sees earlier blocks)."""
    opened: list[TieredStore] = []

    def factory(
        store_config: StoreConfig | None = None, folder: Path | None = tmp_path, order: SlotOrder | None = None
    ) -> TieredStore:
        store = TieredStore.open(folder, LAYOUT, store_config or config(), clock=clock, order=order)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()
