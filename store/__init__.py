"""The tiered KV block store: block keys, the block codec, the device, host and disk tiers, and the store.

Exports: `TieredStore` (open, lookup, fetch, borrow, put, retain, inspect, delete, flush), its `StoreConfig`,
`TierConfig` and `RemoteConfig` (the Redis tier), `Block`, `BlockLayout` and `Keep` (how a block is kept: pinned, own
ttl, retention), `BlockKey`, `Namespace`, `chain_keys`, `tail_key` and `shared_prefix`, what inspection returns
(`PrefixMatch`, `PrefixHit`, `PartialBlock`, `TierStats`, `EntryInfo`), and `Borrowed` (blocks lent in place). The
store knows tensors, bytes and keys; never HTTP or models.
"""

from prefixgate.store.block import Block, BlockLayout, Keep
from prefixgate.store.keys import FORMAT_VERSION, BlockKey, Namespace, chain_keys, shared_prefix, tail_key
from prefixgate.store.tier import EntryInfo, Tier, TierStats
from prefixgate.store.tiered_store import (
    Borrowed,
    HeldRun,
    PartialBlock,
    PrefixHit,
    PrefixMatch,
    RemoteConfig,
    StoreConfig,
    TierConfig,
    TieredStore,
)

__all__ = [
    "FORMAT_VERSION",
    "Block",
    "BlockKey",
    "BlockLayout",
    "Borrowed",
    "EntryInfo",
    "HeldRun",
    "Keep",
    "Namespace",
    "PartialBlock",
    "PrefixHit",
    "PrefixMatch",
    "RemoteConfig",
    "StoreConfig",
    "Tier",
    "TierConfig",
    "TierStats",
    "TieredStore",
    "chain_keys",
    "shared_prefix",
    "tail_key",
]
