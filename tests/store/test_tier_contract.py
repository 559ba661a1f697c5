"""The contract every tier passes: the memory pool tier (device and host) and the LMDB tier alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from prefixgate.errors import BlockMismatchError
from prefixgate.policies import make_policy
from prefixgate.store import Block, BlockKey, Keep, Tier, chain_keys, tail_key
from prefixgate.store.lmdb_tier import LMDBTier
from prefixgate.store.memory_tier import MemoryTier
from tests.store.conftest import BLOCK, LAYOUT, FakeClock, make_kv, make_namespace

TierFactory = Callable[[int], Tier]


def make_tier_blocks(count: int, start: int = 0) -> list[Block]:
    """Return `count` chained blocks of distinct tokens."""
    tokens = list(range(start, start + count * LAYOUT.block_size))
    keys = chain_keys(make_namespace().seed(bytes(32)), tokens, LAYOUT.block_size)
    return [
        Block(key, tuple(tokens[i * 4 : i * 4 + 4]), make_kv(start + i), parent=keys[i - 1] if i else None, created=5.0)
        for i, key in enumerate(keys)
    ]


@pytest.fixture(params=["memory", "lmdb"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierFactory]:
    made: list[Tier] = []

    def factory(capacity_blocks: int) -> Tier:
        clock = FakeClock()
        policy = make_policy("lru", clock=clock)
        tier: Tier
        if request.param == "memory":
            tier = MemoryTier("host", LAYOUT, capacity_blocks * BLOCK, policy, clock=clock)
        else:
            tier = LMDBTier(tmp_path / f"disk{len(made)}", LAYOUT, capacity_blocks * BLOCK, policy, clock=clock)
        made.append(tier)
        return tier

    yield factory
    for tier in made:
        tier.close()


def test_get_returns_an_equal_standalone_copy(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    block = make_tier_blocks(1)[0]
    tier.put(block)
    got = tier.get(block.key, block.tokens)
    assert got is not None
    assert torch.equal(got.kv, block.kv)
    assert (got.tokens, got.parent, got.created) == (block.tokens, block.parent, block.created)
    got.kv.zero_()
    again = tier.get(block.key, block.tokens)
    assert again is not None and torch.equal(again.kv, block.kv)


def test_a_block_whose_tokens_do_not_match_is_a_miss_removed_and_counted(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    block = make_tier_blocks(1)[0]
    tier.put(block)
    assert tier.get(block.key, (9, 9, 9, 9)) is None
    assert not tier.contains(block.key)
    assert tier.counters.corrupt == 1


def test_unknown_key_is_a_miss(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    missing = BlockKey(b"\x07" * 16)
    assert not tier.contains(missing)
    assert tier.get(missing, (0, 1, 2, 3)) is None
    assert tier.entry(missing) is None
    assert not tier.remove(missing)


def test_remove_and_clear_drop_blocks(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    blocks = make_tier_blocks(3)
    for block in blocks:
        tier.put(block)
    assert tier.remove(blocks[0].key)
    assert not tier.contains(blocks[0].key)
    assert len(tier) == 2
    assert tier.clear() == 2
    assert len(tier) == 0 and tier.keys() == []


def test_put_of_a_held_key_replaces_it_in_place(make_tier: TierFactory) -> None:
    tier = make_tier(2)
    block = make_tier_blocks(1)[0]
    tier.put(block)
    tier.put(Block(block.key, block.tokens, torch.ones(LAYOUT.shape), created=5.0))
    assert len(tier) == 1
    got = tier.get(block.key, block.tokens)
    assert got is not None and bool((got.kv == 1).all())


def test_capacity_counts_whole_blocks_and_room_runs_out(make_tier: TierFactory) -> None:
    tier = make_tier(2)
    assert tier.capacity_blocks == 2 and tier.can_hold(2) and not tier.can_hold(3)
    for block in make_tier_blocks(2):
        assert tier.has_room()
        tier.put(block)
    assert not tier.has_room()
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.capacity) == (2, 2 * BLOCK, 2 * BLOCK)


def test_zero_budget_holds_nothing(make_tier: TierFactory) -> None:
    tier = make_tier(0)
    assert tier.capacity_blocks == 0 and not tier.can_hold(1) and not tier.has_room()


def test_a_block_of_another_shape_or_dtype_is_refused(make_tier: TierFactory) -> None:
    tier = make_tier(2)
    block = make_tier_blocks(1)[0]
    with pytest.raises(BlockMismatchError, match="this store holds"):
        tier.put(Block(block.key, block.tokens, block.kv.to(torch.float16)))
    for tokens in ((), (*block.tokens, 1)):
        with pytest.raises(BlockMismatchError, match=f"covers {len(tokens)} tokens"):
            tier.put(Block(block.key, tokens, block.kv))


def test_a_tail_is_held_and_listed_after_its_parent_with_its_few_tokens(make_tier: TierFactory) -> None:
    tier = make_tier(2)
    parent = make_tier_blocks(1)[0]
    tail = Block(tail_key(parent.key, (8, 9)), (8, 9), make_kv(7), parent=parent.key, created=5.0)
    tier.put(parent)
    tier.put(tail)
    assert tier.children(parent.key) == [(tail.key, (8, 9))]
    looked = tier.peek(tail.key)
    assert looked is not None and looked.tokens == (8, 9) and torch.equal(looked.kv, tail.kv)


def test_entries_describe_blocks_and_pins(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    first, second = make_tier_blocks(2)
    tier.put(first, Keep(pinned=True, ttl=60.0))
    tier.put(second)
    tier.get(second.key, second.tokens)
    held = tier.keys()
    entries = {key: tier.entry(key) for key in held}
    assert set(entries) == {first.key, second.key} and tier.entry(BlockKey(b"\x01" * 16)) is None
    assert entries[first.key].pinned and not entries[second.key].pinned
    assert entries[second.key].parent == first.key
    assert entries[second.key].hits == 1
    assert entries[first.key].tokens == LAYOUT.block_size
    assert tier.attrs(first.key) == Keep(pinned=True, ttl=60.0)
    assert tier.pin(first.key, False)
    assert tier.attrs(first.key) == Keep(pinned=False, ttl=60.0)
    assert not tier.pin(BlockKey(b"\x01" * 16), True)


def test_a_retention_is_kept_extended_and_never_shortened(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    block, other = make_tier_blocks(2)
    until = tier.clock() + 300.0
    tier.put(block, Keep(retain_until=until))
    assert tier.attrs(block.key) == Keep(retain_until=until)
    assert tier.retain(block.key, until - 100.0) and tier.attrs(block.key) == Keep(retain_until=until)
    assert tier.retain(block.key, until + 100.0) and tier.attrs(block.key) == Keep(retain_until=until + 100.0)
    entry = tier.entry(block.key)
    assert entry is not None and entry.retained_until == until + 100.0
    assert not tier.retain(other.key, until)  # not held
    tier.put(other)
    assert tier.victim() == other.key  # the unretained block goes first, though it is newer


def test_children_list_the_held_blocks_after_a_block_and_drop_removed_ones(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    first, second, third = make_tier_blocks(3)
    sibling = Block(BlockKey(b"\x07" * 16), (9, 9, 9, 9), make_kv(9), parent=first.key, created=5.0)
    for block in (first, second, third, sibling):
        tier.put(block)
    assert tier.children(first.key) == [(second.key, second.tokens), (sibling.key, sibling.tokens)]
    assert tier.children(second.key) == [(third.key, third.tokens)] and tier.children(third.key) == []
    tier.remove(second.key)
    assert tier.children(first.key) == [(sibling.key, sibling.tokens)]
    tier.clear()
    assert tier.children(first.key) == []


def test_children_give_the_newest_few_and_the_whole_blocks_apart_from_the_tails(make_tier: TierFactory) -> None:
    tier = make_tier(6)
    first, second = make_tier_blocks(2)
    tails = [Block(tail_key(first.key, (i, 9)), (i, 9), make_kv(i), parent=first.key, created=5.0) for i in (3, 4, 5)]
    for block in (first, second, *tails):  # `second` is the one whole block after `first`, older than its tails
        tier.put(block)
    assert tier.children(first.key, newest=2) == [(tail.key, tail.tokens) for tail in tails[1:]]
    assert tier.children(first.key, newest=9) == tier.children(first.key) and len(tier.children(first.key)) == 4
    assert tier.children(first.key, whole=True) == [(second.key, second.tokens)]
    assert tier.children(first.key, newest=1, whole=True) == [(second.key, second.tokens)]
    tier.remove(second.key)
    assert tier.children(first.key, whole=True) == [] and len(tier.children(first.key)) == 3
    tier.remove(tails[0].key)
    assert tier.children(first.key, newest=5) == [(tail.key, tail.tokens) for tail in tails[1:]]


def test_the_policy_names_the_least_recently_used_victim(make_tier: TierFactory) -> None:
    tier = make_tier(4)
    blocks = make_tier_blocks(3)
    for block in blocks:
        tier.put(block)
    tier.get(blocks[0].key, blocks[0].tokens)
    assert tier.victim() == blocks[1].key
