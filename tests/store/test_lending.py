"""Lending blocks in place: running requests read a prefix where the top tier holds it, and it stays while they do."""

from __future__ import annotations

import random

import pytest
import torch

from prefixgate.store import Borrowed, TieredStore
from prefixgate.store.memory_tier import MemoryTier
from tests.store.conftest import BLOCK, StoreFactory, config, make_blocks, make_namespace

NS = make_namespace()
PROMPT = list(range(100, 125))  # 25 tokens: the 6 whole blocks of 4 before its last token may be lent
OTHER = list(range(500, 533))  # 8 whole blocks of another prompt


def host(store: TieredStore) -> MemoryTier:
    tier = store.tiers[0]
    assert isinstance(tier, MemoryTier) and tier.name == "host"
    return tier


def expected(store: TieredStore, tokens: list[int], start: int, stop: int) -> torch.Tensor:
    return torch.cat([block.kv for block in make_blocks(store, tokens)[start:stop]], dim=3)


def test_a_prefix_stored_in_order_is_lent_as_one_view_of_the_tier(open_store: StoreFactory) -> None:
    store = open_store()
    assert store.lends
    store.put(make_blocks(store, PROMPT))
    borrowed = store.borrow(NS, PROMPT, start=1, stop=6)
    assert borrowed.tiers == ("host",) * 5 and len(borrowed.kv) == 1
    (view,) = borrowed.kv
    assert torch.equal(view, expected(store, PROMPT, 1, 6))
    pool = host(store).span(0, 1).untyped_storage()
    assert view.untyped_storage().data_ptr() == pool.data_ptr()  # the tier's memory, not a copy
    assert host(store).lent() == 5
    borrowed.give_back()
    borrowed.give_back()  # once only
    assert host(store).lent() == 0


def stored_apart(store: TieredStore) -> None:
    """Store PROMPT's first 2 blocks, 3 of OTHER after them, then the rest of PROMPT after those."""
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:2])
    store.put(make_blocks(store, OTHER)[:3])
    store.put(blocks[2:])


def test_blocks_stored_apart_are_gathered_into_one_run_before_they_are_lent(open_store: StoreFactory) -> None:
    store = open_store(config(host=16 * BLOCK))
    stored_apart(store)
    borrowed = store.borrow(NS, PROMPT, start=0, stop=6)
    assert len(borrowed.kv) == 1 and borrowed.tiers == ("host",) * 6
    assert torch.equal(borrowed.kv[0], expected(store, PROMPT, 0, 6))
    assert store.fetch(NS, OTHER, stop=3).tiers == ("host",) * 3  # the blocks moved aside are whole
    assert all(
        torch.equal(block.kv, made.kv)
        for block, made in zip(store.fetch(NS, OTHER, stop=3).blocks, make_blocks(store, OTHER), strict=False)
    )
    borrowed.give_back()


def test_blocks_apart_around_lent_ones_are_lent_as_runs_in_order(open_store: StoreFactory) -> None:
    store = open_store(config(host=16 * BLOCK))
    stored_apart(store)
    others = store.borrow(NS, OTHER, start=0, stop=3)  # read in place: they may not move
    borrowed = store.borrow(NS, PROMPT, start=0, stop=6)
    assert [view.shape[3] for view in borrowed.kv] == [8, 16]
    assert torch.equal(torch.cat(borrowed.kv, dim=3), expected(store, PROMPT, 0, 6))
    borrowed.give_back()
    others.give_back()


def test_lent_blocks_are_not_evicted_until_given_back(open_store: StoreFactory) -> None:
    store = open_store()  # a host tier of 8 blocks, a disk tier below
    store.put(make_blocks(store, PROMPT))
    borrowed = store.borrow(NS, PROMPT, start=0, stop=6)
    store.pin(make_blocks(store, PROMPT)[0].key, False)  # unpinning a lent block leaves it lent
    store.put(make_blocks(store, OTHER))
    assert len(host(store)) == 8  # 6 lent, 2 of the other prompt: the rest of it went to disk only
    assert store.lookup(NS, PROMPT).tiers == ("host",) * 6
    assert torch.equal(borrowed.kv[0], expected(store, PROMPT, 0, 6))
    borrowed.give_back()
    store.put(make_blocks(store, OTHER))  # now the prompt's blocks make room, demoted to disk
    assert store.lookup(NS, PROMPT).tiers.count("disk") >= 6 - 2


def test_a_flush_while_blocks_are_lent_keeps_their_memory_until_given_back(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    borrowed = store.borrow(NS, PROMPT, start=0, stop=6)
    assert store.flush() == 6 + 6  # host and disk
    assert len(host(store)) == 0 and store.lookup(NS, PROMPT).tiers == ()
    store.put(make_blocks(store, OTHER))
    assert len(host(store)) == 2  # 6 of its 8 slots are still read
    assert torch.equal(borrowed.kv[0], expected(store, PROMPT, 0, 6))
    borrowed.give_back()
    store.put(make_blocks(store, OTHER))
    assert len(host(store)) == 8  # the slots came back


def test_blocks_below_the_top_tier_are_promoted_to_be_lent(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    store.flush("host")
    borrowed = store.borrow(NS, PROMPT, start=2, stop=6)
    assert borrowed.tiers == ("disk",) * 4
    assert store.lookup(NS, PROMPT).tiers == ("disk", "disk") + ("host",) * 4
    assert torch.equal(torch.cat(borrowed.kv, dim=3), expected(store, PROMPT, 2, 6))
    borrowed.give_back()


def test_a_loan_stops_at_the_first_block_it_cannot_lend(open_store: StoreFactory) -> None:
    store = open_store(config(host=4 * BLOCK))
    others = store.borrow(NS, OTHER, start=0, stop=4)
    assert others.tiers == ()  # nothing stored yet
    store.put(make_blocks(store, OTHER)[:4])
    others = store.borrow(NS, OTHER, start=0, stop=4)  # the whole host tier, lent
    store.put(make_blocks(store, PROMPT))  # on disk only: the host tier has no room
    borrowed = store.borrow(NS, PROMPT, start=0, stop=6)
    assert borrowed.tiers == () and borrowed.kv == ()
    others.give_back()
    assert store.borrow(NS, PROMPT, start=0, stop=6).tiers == ("disk",) * 4  # the tier's 4 slots: no more


def test_a_store_without_memory_on_the_models_device_lends_nothing(open_store: StoreFactory) -> None:
    store = open_store(config(host=0))
    store.put(make_blocks(store, PROMPT))
    assert not store.lends
    assert store.borrow(NS, PROMPT, start=0, stop=6).tiers == ()


def test_random_loans_puts_flushes_and_deletes_never_mix_up_blocks(open_store: StoreFactory) -> None:
    store = open_store(config(host=12 * BLOCK))
    tier = host(store)
    rng = random.Random(7)
    prompts = [[rng.randrange(1000, 9000) for _ in range(4 * rng.randrange(2, 9) + 1)] for _ in range(8)]
    truth = {block.key: block.kv for tokens in prompts for block in make_blocks(store, tokens)}
    loans: list[tuple[list[int], Borrowed]] = []
    for _ in range(1000):
        tokens = rng.choice(prompts)
        action = rng.random()
        if action < 0.4:
            blocks = make_blocks(store, tokens)
            store.put(blocks[rng.randrange(len(blocks)) :] if rng.random() < 0.3 else blocks)
        elif action < 0.6:
            blocks = (len(tokens) - 1) // 4
            loans.append((tokens, store.borrow(NS, tokens, start=0, stop=rng.randrange(1, blocks + 1))))
        elif action < 0.9 and loans:
            loans.pop(rng.randrange(len(loans)))[1].give_back()
        elif action < 0.95:
            store.flush("host")
        else:
            store.delete(make_blocks(store, tokens)[0].key, extensions=True)
        # Every loan still reads its blocks, whatever moved, was evicted or was removed since.
        for lent_tokens, loan in loans:
            if loan.tiers:
                assert torch.equal(torch.cat(loan.kv, dim=3), expected(store, lent_tokens, 0, len(loan.tiers)))
        # Every block the tier holds is the block of its key.
        held = tier.keys()
        for key in held:
            block = tier.peek(key)
            assert block is not None and torch.equal(block.kv, truth[key])
    for _, loan in loans:
        loan.give_back()
    assert tier.lent() == 0
    store.put(make_blocks(store, OTHER)[:8])
    store.put(make_blocks(store, prompts[0]))
    assert len(tier) == 12  # every slot came back


class Reversed:
    """A slot order of the tests' own: each slot's positions last to first."""

    def write(self, slot: torch.Tensor, kv: torch.Tensor) -> None:
        slot.copy_(kv.flip(3))

    def read(self, slot: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(slot.flip(3))


def test_a_top_tier_in_an_order_of_its_own_lends_in_it_and_gives_every_block_in_token_order(
    open_store: StoreFactory,
) -> None:
    order = Reversed()
    store = open_store(config(host=8 * BLOCK), order=order)
    assert store.slot_order is order and host(store).order is order
    blocks = make_blocks(store, PROMPT)
    store.put(blocks)
    borrowed = store.borrow(NS, PROMPT, start=1, stop=6)
    (view,) = borrowed.kv
    assert torch.equal(view, torch.cat([block.kv.flip(3) for block in blocks[1:6]], dim=3))  # as the pool holds it
    # Every block the tier gives is in token order: fetched, read, and what it demotes to disk.
    assert all(
        torch.equal(block.kv, made.kv) for block, made in zip(store.fetch(NS, PROMPT).blocks, blocks, strict=True)
    )
    read = store.read(blocks[2].key)
    assert read is not None and torch.equal(read.kv, blocks[2].kv)
    borrowed.give_back()
    store.put(make_blocks(store, OTHER))  # 8 blocks more than the tier holds: PROMPT's go to disk
    disk = store.tiers[-1]
    on_disk = disk.peek(blocks[0].key)
    assert on_disk is not None and not isinstance(disk, MemoryTier) and torch.equal(on_disk.kv, blocks[0].kv)
    # Promoted back to be lent, in the tier's order again.
    again = store.borrow(NS, PROMPT, start=0, stop=2)
    assert again.tiers == ("disk", "disk") and torch.equal(
        again.kv[0], torch.cat([b.kv.flip(3) for b in blocks[:2]], 3)
    )
    again.give_back()


@pytest.mark.parametrize("order", [None, Reversed()], ids=["token order", "an order of its own"])
def test_a_block_demoted_to_disk_keeps_its_bytes_though_its_slot_is_taken_at_once(
    open_store: StoreFactory, order: Reversed | None
) -> None:
    # A block not on disk (dropped there) is demoted as the top tier makes room: the disk writer encodes it later, so
    # it is handed a block of its own, not the slot that the next block takes at once.
    store = open_store(config(host=8 * BLOCK), order=order)
    blocks = make_blocks(store, PROMPT)
    store.put(blocks)
    store.wait_for_writes()
    disk = store.tiers[-1]
    assert disk.remove(blocks[0].key) and disk.peek(blocks[0].key) is None
    store.put(make_blocks(store, OTHER))  # 8 blocks: PROMPT's make room, into the slots they leave
    store.wait_for_writes()
    on_disk = disk.peek(blocks[0].key)
    assert on_disk is not None and torch.equal(on_disk.kv, blocks[0].kv)
    assert host(store).counters.demotions >= 1
