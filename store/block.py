"""The unit of caching: the K and V of `block_size` consecutive tokens for every layer."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import Protocol

import torch

from prefixgate.errors import BlockMismatchError
from prefixgate.store.keys import BlockKey


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """The shape and dtype every block of one store has."""

    shape: tuple[int, ...]  # [layers, 2, kv_heads, block_size, head_dim]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if len(self.shape) != 5 or self.shape[1] != 2 or min(self.shape) <= 0:
            raise BlockMismatchError(
                f"a block shape is [layers, 2, kv_heads, block_size, head_dim] with positive sizes, got {self.shape}"
            )

    @property
    def block_size(self) -> int:
        """Return the number of tokens one block covers."""
        return self.shape[3]

    @property
    def nbytes(self) -> int:
        """Return the size of one block's tensor in bytes."""
        return prod(self.shape) * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        """Return the dtype as the short name torch uses (`float32`, `bfloat16`, ...)."""
        return str(self.dtype).removeprefix("torch.")

    def check(self, block: Block) -> None:
        """Raise BlockMismatchError unless `block` fits this layout."""
        if tuple(block.kv.shape) != self.shape or block.kv.dtype != self.dtype:
            raise BlockMismatchError(
                f"block {block.key.hex()} is {tuple(block.kv.shape)} {block.kv.dtype}, "
                f"but this store holds {self.shape} {self.dtype}"
            )
        if not 0 < len(block.tokens) <= self.block_size:
            raise BlockMismatchError(
                f"block {block.key.hex()} covers {len(block.tokens)} tokens, but blocks here cover {self.block_size} "
                "(a tail, fewer)"
            )


@dataclass(frozen=True, slots=True)
class Block:
    """One cached block: its key, the token ids it covers, its KV tensor and where it came from.

    A whole block covers `block_size` tokens. A tail covers fewer: the end of a sequence, K and V in its leading
    positions; it is found after its parent and reused as far as its tokens go (see `keys.tail_key`).
    """

    key: BlockKey
    tokens: tuple[int, ...]
    kv: torch.Tensor = field(repr=False)  # kv: [layers, 2, kv_heads, block_size, head_dim]
    parent: BlockKey | None = None  # the key of the block before it; None for block 0
    tenant: str = ""  # who computed it, for inspection; isolation comes from the key's namespace
    created: float = 0.0  # wall-clock seconds, for inspection


class SlotOrder(Protocol):
    """How a memory tier lays each slot's K and V out where not token by token: as a model's attention kernel reads
    them, so that a prefix lent in place needs no repacking per step (`backends.cpu_attention.KernelOrder`). Only
    the tier's pool is in this order: every block it takes or gives is in token order."""

    def write(self, slot: torch.Tensor, kv: torch.Tensor) -> None:
        """Lay `kv` (`[layers, 2, kv_heads, block_size, head_dim]`, in token order) out in `slot` (the same shape)."""
        ...

    def read(self, slot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Return `slot`'s K and V in token order, written into `out` (the same shape)."""
        ...


@dataclass(frozen=True, slots=True)
class Keep:
    """How the store keeps a block, beyond its policies: pinned, its own lifetime, and a retention."""

    pinned: bool = False  # never evicted until unpinned; it still expires
    ttl: float | None = None  # its own lifetime, in seconds from `Block.created`: it expires then
    # Wall-clock seconds: until then it never expires, and it is evicted only when nothing unretained is left to go.
    retain_until: float | None = None

    def merged(self, other: Keep) -> Keep:
        """Return these attributes with `other`'s retention kept where it lasts longer."""
        ends = [until for until in (self.retain_until, other.retain_until) if until is not None]
        return replace(self, retain_until=max(ends, default=None))


BY_POLICY = Keep()  # a block its tiers' policies alone keep: the default


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype named `name` (`float32`, `bfloat16`, ...); raise ValueError on anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
