"""The tiered store: longest prefix, movement between tiers, persistence, inspection and removal."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch

from prefixgate.errors import StoreError
from prefixgate.policies import make_policy
from prefixgate.store import (
    Block,
    BlockKey,
    BlockLayout,
    EntryInfo,
    Namespace,
    TieredStore,
    chain_keys,
    tail_key,
    tiered_store,
)
from prefixgate.store.lmdb_tier import LMDBTier
from prefixgate.store.memory_tier import MemoryTier, pins_pool
from prefixgate.store.tiered_store import StoreConfig, TierConfig
from tests.store.conftest import (
    BLOCK,
    LAYOUT,
    FakeClock,
    StoreFactory,
    config,
    make_blocks,
    make_kv,
    make_namespace,
)

NS = make_namespace()
HANG_GUARD_SECONDS = 60  # only a broken build waits this long
PROMPT = list(range(100, 124))  # 24 tokens: 6 blocks of 4


def tiers_of(store: TieredStore, tokens: list[int] = PROMPT) -> tuple[str, ...]:
    return store.lookup(NS, tokens).tiers


def test_longest_prefix_is_the_run_of_leading_blocks_present(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT[:12]))  # blocks 0..2
    query = PROMPT[:12] + [7, 7, 7, 7, 7]
    hit = store.fetch(NS, query)
    assert hit.cached_tokens == 12
    assert [block.tokens for block in hit.blocks] == [tuple(PROMPT[i : i + 4]) for i in (0, 4, 8)]
    assert all(torch.equal(b.kv, make_kv(int.from_bytes(b.key.digest[:4], "little"))) for b in hit.blocks)


def test_a_prefix_fetched_into_a_given_tensor_fills_its_leading_positions(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT[:12]))
    layers, two, heads, size, head_dim = LAYOUT.shape
    out = torch.full((layers, two, heads, 40, head_dim), -1.0)  # out: [layers, 2, kv_heads, capacity, head_dim]
    hit = store.fetch(NS, PROMPT, out)
    assert hit.cached_tokens == 12
    for index, block in enumerate(hit.blocks):
        slot = out[:, :, :, index * size : (index + 1) * size]
        assert block.kv.data_ptr() == slot.data_ptr() and torch.equal(slot, make_blocks(store, PROMPT)[index].kv)
    assert bool((out[:, :, :, 12:] == -1.0).all())  # the rest is left alone


def test_a_tensor_too_small_or_of_another_layout_to_fetch_into_is_refused(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    layers, two, heads, _, head_dim = LAYOUT.shape
    for wrong in (
        torch.empty((layers, two, heads, 8, head_dim)),  # room for 2 blocks, the prompt may reuse 5
        torch.empty((layers, two, heads + 1, 40, head_dim)),
        torch.empty((layers, two, heads, 40, head_dim), dtype=torch.float16),
    ):
        with pytest.raises(ValueError, match=r"fetch\(out=\) needs a float32 tensor on cpu of shape \[2, 2, 2"):
            store.fetch(NS, PROMPT, wrong)
    assert store.fetch(NS, PROMPT).cached_tokens == 23  # nothing lost: all but the last token


def test_a_gap_ends_the_prefix_even_when_later_blocks_are_cached(open_store: StoreFactory) -> None:
    store = open_store()
    blocks = make_blocks(store, PROMPT)
    store.put([blocks[0], blocks[2], blocks[3]])
    assert store.fetch(NS, PROMPT).cached_tokens == 4


def test_a_whole_prompt_hit_leaves_its_last_token_to_compute(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    # 24 tokens: five whole blocks, and the first three tokens of the sixth, which holds the last one
    match = store.lookup(NS, PROMPT)
    assert match.cached_tokens == 23 and match.partial is not None and match.partial.tokens == 3
    assert store.lookup(NS, PROMPT + [1]).cached_tokens == 24
    assert store.lookup(NS, []).cached_tokens == 0


@pytest.mark.parametrize("shared", [0, 1, 2, 3])  # 4-token blocks: none, one, a middle count, all but one
@pytest.mark.parametrize("where", ["host", "disk"])
def test_the_block_after_a_prefix_is_reused_up_to_the_first_token_that_differs(
    open_store: StoreFactory, shared: int, where: str
) -> None:
    store = open_store(config(host=8 * BLOCK if where == "host" else 0))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks)
    store.wait_for_writes()
    other = PROMPT[: 8 + shared] + [7] * 8  # departs in block 2, after `shared` of its tokens
    assert store.lookup(NS, other).cached_tokens == 8 + shared
    layers, two, heads, _, head_dim = LAYOUT.shape
    out = torch.full((layers, two, heads, 40, head_dim), -1.0)  # out: [layers, 2, kv_heads, capacity, head_dim]
    hit = store.fetch(NS, other, out)
    assert hit.cached_tokens == 8 + shared and hit.tokens_by_tier == {where: 8 + shared}
    assert hit.partial is not None and (hit.partial.key, hit.partial.tokens) == (blocks[2].key, shared)
    assert [kv.shape[3] for kv in hit.kv] == [4, 4] + ([shared] if shared else [])
    assert torch.equal(out[:, :, :, 8 : 8 + shared], blocks[2].kv[:, :, :, :shared])
    assert bool((out[:, :, :, 8 + shared :] == -1.0).all())  # never a position past the shared ones


def test_the_continuation_sharing_the_most_tokens_is_chosen_and_the_last_token_is_left(
    open_store: StoreFactory,
) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT[:8] + [1, 2, 9, 9]))
    store.put(make_blocks(store, PROMPT[:8] + [1, 2, 3, 9]))
    store.put(make_blocks(store, PROMPT[:8] + [1, 9, 9, 9]))
    assert store.lookup(NS, PROMPT[:8] + [1, 2, 3, 4, 5]).cached_tokens == 11
    assert store.lookup(NS, PROMPT[:8] + [1, 2, 3]).cached_tokens == 10  # the last token starts the answer


def test_a_partial_block_comes_only_from_the_same_namespace(open_store: StoreFactory) -> None:
    store = open_store()
    other = make_namespace(tenant="other")
    store.put(make_blocks(store, PROMPT))
    store.put(make_blocks(store, PROMPT[:8], other))  # the other tenant holds the first two blocks only
    assert store.lookup(NS, PROMPT[:10] + [7]).cached_tokens == 10
    match = store.lookup(other, PROMPT[:10] + [7])
    assert match.cached_tokens == 8 and match.partial is None  # the same tokens after it are not its blocks


def test_a_fork_is_found_after_a_block_that_many_tails_follow(open_store: StoreFactory) -> None:
    store = open_store()
    blocks = make_blocks(store, PROMPT[:12])  # blocks 0..2
    store.put(blocks)
    tails = [Block(tail_key(blocks[0].key, (i, 8)), (i, 8), make_kv(i), parent=blocks[0].key) for i in range(5)]
    store.put(tails)  # prompts that stopped short of a whole block after block 0: no fork
    assert store.held(NS, PROMPT[:12] + [7]).forks == ()
    store.put(make_blocks(store, PROMPT[:4] + [9, 9, 9, 9])[1:])  # a second whole block after block 0
    store.put([Block(tail_key(blocks[0].key, (6, 8)), (6, 8), make_kv(6), parent=blocks[0].key)])  # newer than both
    assert store.held(NS, PROMPT[:12] + [7]).forks == (1,)


def test_an_evicted_block_is_no_longer_found_after_its_parent(open_store: StoreFactory) -> None:
    store = open_store(config(host=2 * BLOCK), folder=None)
    blocks = make_blocks(store, PROMPT)
    for block in blocks[:3]:
        store.put([block])  # a tier of two: block 0 is evicted
    (host,) = store.tiers
    assert host.children(blocks[0].key) == [(blocks[1].key, blocks[1].tokens)]
    store.put(blocks[3:4])  # evicts block 1
    assert host.children(blocks[0].key) == []
    assert host.children(blocks[1].key) == [(blocks[2].key, blocks[2].tokens)]  # held, though its parent is not
    assert store.lookup(NS, PROMPT).cached_tokens == 0


def test_inserts_go_to_the_top_tier_and_through_to_disk(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    store.wait_for_writes()
    host, disk = store.stats()
    assert (host.name, host.entries, disk.name, disk.entries) == ("host", 6, "disk", 6)
    assert set(store.lookup(NS, PROMPT + [0]).tiers) == {"host"}


def test_eviction_demotes_to_the_next_tier_in_lru_order(open_store: StoreFactory) -> None:
    store = open_store(config(device=2 * BLOCK, host=2 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    for block in blocks[:5]:
        store.put([block])
    # device holds the two newest; host the two before; the first fell to disk only.
    assert tiers_of(store) == ("disk", "host", "host", "device", "device")
    device, host, disk = store.stats()
    assert (device.demotions, host.demotions, disk.entries) == (3, 1, 5)


def test_a_hit_below_the_top_is_promoted_to_the_top(open_store: StoreFactory) -> None:
    store = open_store(config(device=2 * BLOCK, host=8 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:2])
    store.put(blocks[2:4])  # pushes blocks 0 and 1 down to the host tier
    assert tiers_of(store, PROMPT[:9]) == ("host", "host")
    hit = store.fetch(NS, PROMPT[:9])
    assert hit.tiers == ("host", "host") and hit.tokens_by_tier == {"host": 8}
    assert tiers_of(store, PROMPT[:9]) == ("device", "device")
    device, host, _ = store.stats()
    assert host.promotions == 2 and host.hits == 2 and device.misses == 2
    assert host.entries == 2  # blocks 2 and 3, demoted to make room; memory tiers never hold a block twice


def test_a_set_too_big_for_a_tier_skips_it(open_store: StoreFactory) -> None:
    store = open_store(config(host=4 * BLOCK))
    store.put(make_blocks(store, PROMPT))  # 6 blocks > 4 slots
    store.wait_for_writes()
    host, disk = store.stats()
    assert (host.entries, disk.entries) == (0, 6)


def test_a_tier_smaller_than_one_block_is_skipped(open_store: StoreFactory) -> None:
    store = open_store(config(host=BLOCK // 2))
    store.put(make_blocks(store, PROMPT))
    assert store.fetch(NS, PROMPT).tiers == ("disk",) * 5
    assert store.stats()[0].entries == 0


def test_every_budget_zero_is_an_error_that_says_what_to_set(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="give at least one tier some bytes"):
        TieredStore.open(tmp_path, LAYOUT, config(host=0, disk=0))


def test_memory_only_store_works_without_a_folder(open_store: StoreFactory) -> None:
    store = open_store(folder=None)
    store.put(make_blocks(store, PROMPT))
    assert [tier.name for tier in store.tiers] == ["host"]
    assert store.fetch(NS, PROMPT).cached_tokens == 23


def test_cpu_defaults_do_not_hold_blocks_twice() -> None:
    defaults = StoreConfig.defaults(torch.device("cpu"))
    assert defaults.device.capacity_bytes == 0 and defaults.host.capacity_bytes > 0


def test_reopening_serves_earlier_blocks_under_the_same_namespace_only(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    store.close()
    reopened = open_store()
    assert reopened.fetch(NS, PROMPT).tiers == ("disk",) * 5
    for other in (make_namespace(tenant="someone-else"), make_namespace(model="model-b")):
        assert reopened.fetch(other, PROMPT).cached_tokens == 0


def test_a_closed_store_lets_go_of_its_memory_tiers_pool(open_store: StoreFactory) -> None:
    # Something may still reference a closed store: aiohttp's cache of middleware chains keeps a closed server's app,
    # and with it the engine and its store. Each app the tests start left 80 MB behind before.
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    host = store.tiers[0]
    assert isinstance(host, MemoryTier) and len(host) == 6
    pool = host.span(0, 1).untyped_storage().data_ptr()
    store.close()
    gc.collect()
    assert len(host) == 0 and host.span(0, host.capacity_blocks).numel() == 0
    # Plain CPU tensors only: the pool's views are such, and compiled steps elsewhere in the process leave fake ones,
    # which have no memory to point at.
    held = [found for found in gc.get_objects() if type(found) is torch.Tensor and found.device.type == "cpu"]
    assert not any(tensor.untyped_storage().data_ptr() == pool for tensor in held)
    assert open_store().fetch(NS, PROMPT).tiers == ("disk",) * 5  # what was written through is on disk


def test_a_value_corrupted_on_disk_is_a_miss_dropped_and_counted(open_store: StoreFactory, tmp_path: Path) -> None:
    import lmdb

    store = open_store()
    blocks = make_blocks(store, PROMPT)
    store.put(blocks)
    store.close()
    with lmdb.open(str(tmp_path / "blocks.lmdb")) as env, env.begin(write=True) as txn:
        value = bytearray(txn.get(blocks[2].key.digest))
        value[-1] ^= 0xFF
        txn.put(blocks[2].key.digest, bytes(value))
    reopened = open_store()
    assert reopened.fetch(NS, PROMPT).cached_tokens == 8
    disk = reopened.stats()[-1]
    assert disk.corrupt == 1 and disk.entries == 5
    assert reopened.lookup(NS, PROMPT).cached_tokens == 8


def test_ttl_expires_blocks_on_the_fake_clock(open_store: StoreFactory, clock: FakeClock) -> None:
    store = open_store(config(ttl=60.0))
    store.put(make_blocks(store, PROMPT))
    clock.advance(59)
    assert store.fetch(NS, PROMPT).cached_tokens == 23
    clock.advance(2)
    assert store.fetch(NS, PROMPT).cached_tokens == 0
    assert [s.expirations for s in store.stats()] == [6, 6]


def test_a_per_block_ttl_survives_moves_between_tiers(open_store: StoreFactory, clock: FakeClock) -> None:
    store = open_store(config(device=2 * BLOCK, host=2 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:1], ttl=30.0)
    clock.advance(20)
    store.put(blocks[1:3])  # demotes block 0 to the host tier
    assert tiers_of(store)[0] == "host"
    clock.advance(11)
    assert store.fetch(NS, PROMPT).cached_tokens == 0


def test_a_promotion_the_top_tier_cannot_take_leaves_the_block_where_it_was(open_store: StoreFactory) -> None:
    store = open_store(config(device=2 * BLOCK, host=4 * BLOCK), folder=None)  # no disk tier to fall back on
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:2], pinned=True)  # the device tier is full of pinned blocks
    store.put(blocks[2:5])  # three blocks: too many for the device tier, so they go to the host tier
    assert tiers_of(store) == ("device", "device", "host", "host", "host")
    hit = store.fetch(NS, PROMPT)
    assert hit.tiers == ("device", "device", "host", "host", "host")
    assert all(torch.equal(got.kv, block.kv) for got, block in zip(hit.blocks, blocks, strict=False))
    assert tiers_of(store) == ("device", "device", "host", "host", "host")  # kept, not lost
    assert store.fetch(NS, PROMPT).cached_tokens == 20
    assert store.stats()[1].promotions == 0


def test_pinned_blocks_are_never_evicted_until_unpinned(open_store: StoreFactory) -> None:
    store = open_store(config(host=2 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:2], pinned=True)
    store.put(blocks[2:4])  # the host tier is all pinned: these go to disk only
    assert tiers_of(store) == ("host", "host", "disk", "disk")
    assert all(entry.pinned for entry in store.entries(tier="host"))
    assert store.pin(blocks[0].key, False)
    store.put(blocks[4:5])
    assert tiers_of(store) == ("disk", "host", "disk", "disk", "host")


def test_a_retained_block_is_evicted_after_unretained_ones_and_keeps_its_retention_below(
    open_store: StoreFactory, clock: FakeClock
) -> None:
    store = open_store(config(device=2 * BLOCK, host=2 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:1], retain=300.0)
    clock.advance(1)
    for block in blocks[1:4]:  # three newer blocks through a device tier of two: the unretained ones go down first
        store.put([block])
    assert tiers_of(store)[:4] == ("device", "host", "host", "device")
    store.put(blocks[4:5], retain=600.0)  # now both device blocks are retained: the one whose retention ends first goes
    store.put(blocks[5:6])
    (retained,) = [entry for entry in store.entry(blocks[0].key) if entry.tier != "disk"]
    assert (retained.tier, retained.retained_until) == ("host", 1_000_000.0 + 300.0)
    assert tiers_of(store, PROMPT + [0]) == ("host", "disk", "disk", "host", "device", "device")


def test_a_retention_outlives_the_tiers_ttl_and_a_hit_extends_it(open_store: StoreFactory, clock: FakeClock) -> None:
    store = open_store(config(ttl=60.0))
    blocks = make_blocks(store, PROMPT)
    store.put(blocks[:2], retain=100.0)
    store.put(blocks[2:])
    clock.advance(90)
    assert store.retain([block.key for block in blocks[:3]], 50.0) == 2  # block 2 expired already
    clock.advance(49)
    assert store.fetch(NS, PROMPT).cached_tokens == 8  # kept 139 s and counting, past the tiers' 60 s ttl
    assert all(entry.retained_until == 1_000_000.0 + 140.0 for entry in store.entries())
    clock.advance(1)
    assert store.fetch(NS, PROMPT).cached_tokens == 0


def test_a_retention_written_with_a_block_holds_after_a_restart(
    open_store: StoreFactory, clock: FakeClock, tmp_path: Path
) -> None:
    store = open_store(config(ttl=60.0), folder=tmp_path)
    store.put(make_blocks(store, PROMPT[:8]), retain=3600.0)
    store.close()
    clock.advance(120)
    reopened = open_store(config(ttl=60.0), folder=tmp_path)
    assert reopened.fetch(NS, PROMPT).cached_tokens == 8
    assert {entry.retained_until for entry in reopened.entries(tier="disk")} == {1_000_000.0 + 3600.0}


def test_delete_with_extensions_removes_the_block_and_every_block_after_it(open_store: StoreFactory) -> None:
    store = open_store()
    blocks = make_blocks(store, PROMPT)
    branch = make_blocks(store, PROMPT[:8] + [5] * 8)  # shares blocks 0 and 1
    store.put(blocks)
    store.put(branch[2:])
    assert store.delete(blocks[1].key, extensions=True) == 2 * (1 + 4 + 2)  # host and disk copies
    assert store.lookup(NS, PROMPT + [0]).cached_tokens == 4
    assert store.delete(blocks[1].key) == 0


def test_delete_one_block_keeps_the_rest(open_store: StoreFactory) -> None:
    store = open_store()
    blocks = make_blocks(store, PROMPT)
    store.put(blocks)
    assert store.delete(blocks[5].key) == 2
    assert store.lookup(NS, PROMPT + [0]).cached_tokens == 20


def test_flush_one_tier_or_everything(open_store: StoreFactory) -> None:
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    assert store.flush("host") == 6
    assert set(tiers_of(store)) == {"disk"}
    assert store.flush() == 6
    assert store.lookup(NS, PROMPT).cached_tokens == 0
    with pytest.raises(StoreError, match="this store has: host, disk"):
        store.flush("gpu")


def test_flushing_the_disk_tier_keeps_the_blocks_of_another_model_sharing_its_database(
    open_store: StoreFactory, tmp_path: Path, clock: FakeClock
) -> None:
    other_layout = BlockLayout(LAYOUT.shape, torch.float16)  # another model: its blocks are float16
    other = Namespace("model-b", "tok", "float16", LAYOUT.shape)
    with TieredStore.open(tmp_path, other_layout, config(), clock=clock) as store_b:
        keys = chain_keys(store_b.seed(other), PROMPT, LAYOUT.block_size)
        theirs = [
            Block(key, tuple(PROMPT[i * 4 : i * 4 + 4]), make_kv(i).half(), parent=keys[i - 1] if i else None)
            for i, key in enumerate(keys)
        ]
        store_b.put(theirs)
    store = open_store()
    store.put(make_blocks(store, PROMPT))
    assert store.flush("disk") == 6  # this model's blocks: the database holds twelve
    store.close()
    with TieredStore.open(tmp_path, other_layout, config(), clock=clock) as store_b:
        hit = store_b.fetch(other, PROMPT + [0])
        assert hit.tiers == ("disk",) * 6
        assert all(torch.equal(got.kv, block.kv) for got, block in zip(hit.blocks, theirs, strict=True))
    assert open_store().lookup(NS, PROMPT + [0]).cached_tokens == 0


def test_reading_a_block_moves_and_counts_nothing_in_any_tier(open_store: StoreFactory) -> None:
    store = open_store(config(device=2 * BLOCK, host=2 * BLOCK))
    blocks = make_blocks(store, PROMPT)
    for block in blocks[:5]:
        store.put([block])
    store.wait_for_writes()
    assert tiers_of(store) == ("disk", "host", "host", "device", "device")

    def state() -> object:
        return store.stats(), store.entries(), [tier.victim() for tier in store.tiers]

    before = state()
    for block in blocks[:5]:
        read = store.read(block.key)
        assert read is not None and torch.equal(read.kv, block.kv)
    assert state() == before


def test_a_disk_writer_too_far_behind_drops_write_throughs_keeps_them_in_memory_and_counts_them(
    tmp_path: Path, clock: FakeClock
) -> None:
    host = MemoryTier("host", LAYOUT, 8 * BLOCK, make_policy("lru", clock=clock), clock=clock)
    lru = make_policy("lru", clock=clock)
    disk = LMDBTier(tmp_path, LAYOUT, 64 * BLOCK, lru, clock=clock, queue_bytes=2 * BLOCK)
    with TieredStore([host, disk], secret=bytes(32), clock=clock) as store:
        blocks = make_blocks(store, PROMPT)
        with disk._env.begin(write=True):  # holds LMDB's write lock: the disk writer cannot commit yet
            assert store.put(blocks[:4]) == 4
        store.wait_for_writes()
        assert [(stats.name, stats.entries, stats.dropped_writes) for stats in store.stats()] == [
            ("host", 4, 0),
            ("disk", 2, 2),
        ]
        assert store.fetch(NS, PROMPT).tiers == ("host",) * 4  # every block is still served


def test_only_a_cpu_pool_serving_a_cuda_model_is_pinned() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert pins_pool(cpu, cuda)  # the host tier of a model on a GPU
    assert not pins_pool(cuda, cuda)  # the device tier: GPU memory cannot be pinned
    assert not pins_pool(cpu, cpu)  # host and device tiers of a model on the CPU: nothing to copy to a GPU


def test_entries_filter_by_tier_and_tenant(open_store: StoreFactory) -> None:
    store = open_store()
    acme = make_namespace(tenant="acme")
    store.put(make_blocks(store, PROMPT[:8]))
    store.put(make_blocks(store, PROMPT[:8], acme))
    assert len(store.entries()) == 8
    assert len(store.entries(tier="host", tenant="acme")) == 2
    key = store.entries(tenant="acme")[0].key
    assert {entry.tier for entry in store.entry(key)} == {"host", "disk"}
    block = store.read(key)
    assert block is not None and block.tenant == "acme"


def test_a_long_listing_lets_lookups_through_between_its_chunks(
    open_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(config(host=2048 * BLOCK, disk=0), folder=None)
    tokens = list(range(2048 * LAYOUT.block_size))
    store.put(make_blocks(store, tokens))
    looked_up: list[int] = []

    def between_chunks(seconds: float) -> None:
        # Where the listing yields between chunks, another thread's lookup must get the lock and finish: were the
        # lock still held here, the lookup would wait and the join below would give up.
        assert seconds == 0
        lookup = threading.Thread(target=lambda: looked_up.append(store.lookup(NS, tokens[:16]).cached_tokens))
        lookup.start()
        lookup.join(HANG_GUARD_SECONDS)
        assert not lookup.is_alive(), "a lookup waited for the lock between two chunks of a listing"

    monkeypatch.setattr(tiered_store.time, "sleep", between_chunks)
    assert len(store.entries()) == 2048
    assert looked_up == [15] * (2048 // tiered_store._LISTING_CHUNK)


def test_a_block_stored_during_a_listing_is_listed_in_no_tier_rather_than_one(open_store: StoreFactory) -> None:
    store = open_store()  # host and disk: every block is in both
    store.put(make_blocks(store, PROMPT[:8]))
    host, _ = store.tiers
    entry = host.entry
    late = make_blocks(store, PROMPT[:12])[2:]

    def entry_then_store(key: BlockKey) -> EntryInfo | None:
        if late:
            store.put([late.pop()])  # another request's block, filed while the listing reads the host tier
        return entry(key)

    host.entry = entry_then_store  # type: ignore[method-assign]
    listed = store.entries()
    by_tier = {tier: {e.key for e in listed if e.tier == tier} for tier in ("host", "disk")}
    assert by_tier["host"] == by_tier["disk"] and len(by_tier["host"]) == 2
    assert len(store.entries()) == 6  # the next listing shows it in both


def test_another_process_sees_blocks_this_one_writes(open_store: StoreFactory, tmp_path: Path) -> None:
    import subprocess
    import sys

    store = open_store()
    child = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[2])!r})
from pathlib import Path
from prefixgate.store import TieredStore
from tests.store.conftest import LAYOUT, config, make_blocks
with TieredStore.open(Path({str(tmp_path)!r}), LAYOUT, config()) as store:
    store.put(make_blocks(store, {PROMPT!r}))
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    hit = store.fetch(NS, PROMPT)
    assert hit.tiers == ("disk",) * 5
    assert store.lookup(NS, PROMPT).tiers == ("host",) * 5  # promoted on the way


async def test_concurrent_tasks_and_threads_see_consistent_blocks(open_store: StoreFactory) -> None:
    store = open_store(config(device=6 * BLOCK, host=10 * BLOCK))
    prompts = [[i % 3] * 8 + list(range(100 * i, 100 * i + 16)) for i in range(12)]
    failures: list[str] = []

    def work(prompt: list[int]) -> None:
        for _ in range(5):
            store.put(make_blocks(store, prompt))
            hit = store.fetch(NS, prompt + [0])
            for index, block in enumerate(hit.blocks):
                expected = make_kv(int.from_bytes(block.key.digest[:4], "little"))
                if block.tokens != tuple(prompt[index * 4 : index * 4 + 4]) or not torch.equal(block.kv, expected):
                    failures.append(f"wrong block {index} for prompt {prompt[8]}")

    threads = [threading.Thread(target=work, args=(prompt,)) for prompt in prompts[:6]]
    for thread in threads:
        thread.start()
    await asyncio.gather(*(asyncio.to_thread(work, prompt) for prompt in prompts[6:]))
    for thread in threads:
        thread.join()
    assert failures == []
    store.wait_for_writes()
    for prompt in prompts:
        assert store.lookup(NS, prompt + [0]).cached_tokens == 24
    device, host, disk = store.stats()
    assert device.entries + host.entries <= 16 and disk.entries == len({e.key for e in store.entries()})


def test_an_unknown_policy_name_is_an_error_listing_the_valid_ones(tmp_path: Path) -> None:
    bad = StoreConfig(device=TierConfig(0), host=TierConfig(BLOCK, policy="lfu"), disk=TierConfig(BLOCK))
    with pytest.raises(KeyError, match="lru"):
        TieredStore.open(tmp_path, LAYOUT, bad)


def test_the_store_folder_secret_and_lmdb_files_are_their_owners_alone(
    open_store: StoreFactory, tmp_path: Path
) -> None:
    folder = tmp_path / "store"
    store = open_store(folder=folder)
    store.wait_for_writes()
    modes = {path.relative_to(folder).as_posix(): path.stat().st_mode & 0o777 for path in [folder, *folder.rglob("*")]}
    assert modes.pop(".") == 0o700
    assert modes.pop("secret") == 0o600
    assert modes, "the LMDB tier's folder and files are there too"
    assert all(mode == (0o700 if (folder / name).is_dir() else 0o600) for name, mode in modes.items()), modes


def test_seeding_many_salted_namespaces_keeps_nothing_per_namespace(open_store: StoreFactory) -> None:
    # Clients choose `cache_salt`: whatever the store remembers per namespace would grow with every salt sent.
    store = open_store()
    salted = [make_namespace(tenant=f"salt-{i}") for i in range(20_000)]
    store.seed(salted[0])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        seeds = {store.seed(namespace) for namespace in salted}
        del seeds
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 100_000, f"the store kept {kept} bytes for 20,000 namespaces"
