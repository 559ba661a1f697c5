"""The LMDB tier's own behaviour: a map that grows, a ceiling that evicts, and surviving SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from prefixgate.policies import make_policy
from prefixgate.store import Block, BlockLayout, chain_keys
from prefixgate.store.lmdb_tier import LMDBTier
from tests.store.conftest import FakeClock, make_namespace

BIG = BlockLayout(shape=(4, 2, 4, 16, 64), dtype=torch.float32)  # 128 KiB a block
REPO = Path(__file__).parents[2]


def big_blocks(count: int) -> list[Block]:
    tokens = list(range(count * 16))
    keys = chain_keys(make_namespace().seed(bytes(32)), tokens, 16)
    return [
        Block(key, tuple(tokens[i * 16 : i * 16 + 16]), torch.full(BIG.shape, float(i)), created=1.0)
        for i, key in enumerate(keys)
    ]


def open_tier(path: Path, capacity_blocks: int, **map_sizes: int) -> LMDBTier:
    clock = FakeClock()
    policy = make_policy("lru", clock=clock)
    return LMDBTier(path, BIG, capacity_blocks * BIG.nbytes, policy, clock=clock, **map_sizes)


def test_a_full_map_grows_instead_of_failing(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100, map_bytes=1 << 20)
    blocks = big_blocks(40)  # 5 MiB into a 1 MiB map
    for block in blocks:
        tier.put(block)
    tier.flush()
    assert tier._env.info()["map_size"] > 5 << 20
    assert all(tier.get(block.key, block.tokens) is not None for block in blocks)
    assert tier.counters.evictions == 0
    tier.close()


def test_a_map_at_its_ceiling_evicts_least_recently_used_blocks(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100, map_bytes=1 << 20, max_map_bytes=2 << 20)
    blocks = big_blocks(30)  # 3.75 MiB of payload into a 2 MiB ceiling
    for block in blocks:
        tier.put(block)
    tier.flush()
    kept = [block for block in blocks if tier.get(block.key, block.tokens) is not None]
    assert 0 < len(kept) < 30
    assert kept == blocks[-len(kept) :]  # the oldest went first
    assert tier.counters.evictions == 30 - len(kept) == 30 - len(tier)
    tier.close()


def test_a_map_full_of_pinned_blocks_drops_the_new_write_and_keeps_the_old(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100, map_bytes=1 << 20, max_map_bytes=1 << 20)
    blocks = big_blocks(12)
    for block in blocks:
        tier.put(block, pinned=True)
    tier.flush()
    held = [block for block in blocks if tier.get(block.key, block.tokens) is not None]
    assert 0 < len(held) < 12
    assert len(tier) == len(held)  # nothing claims blocks that never reached the disk
    tier.close()


WRITER = """
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from prefixgate.store import TieredStore
from tests.store.conftest import LAYOUT, config, make_blocks
store = TieredStore.open(Path({folder!r}), LAYOUT, config(host=4 * LAYOUT.nbytes, disk=100_000 * LAYOUT.nbytes))
round = 0
while True:
    store.put(make_blocks(store, [round] * 4 + list(range(64))))
    round += 1
    if round == 20:
        print("writing", flush=True)
"""


def test_a_clear_still_queued_for_the_writer_already_hides_what_is_on_disk(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100)
    old, new = big_blocks(2)
    tier.put(old)
    tier.flush()
    with tier._env.begin(write=True):  # holds LMDB's write lock: the writer cannot commit the clear yet
        assert tier.clear() == 1
        tier.put(new)
        assert tier.get(old.key, old.tokens) is None
        assert not tier.contains(old.key)
        assert tier.get(new.key, new.tokens) is not None  # written after the clear, still pending
    tier.flush()
    assert tier.get(old.key, old.tokens) is None
    assert tier.keys() == [new.key]
    tier.close()


def test_sigkill_during_writes_leaves_only_whole_verified_blocks(tmp_path: Path) -> None:
    from prefixgate.store import TieredStore
    from tests.store.conftest import LAYOUT, config, make_namespace

    child = subprocess.Popen(
        [sys.executable, "-c", WRITER.format(repo=str(REPO), folder=str(tmp_path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "writing"
    time.sleep(0.5)  # mid-stream: the writer thread is committing batches
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)

    with TieredStore.open(tmp_path, LAYOUT, config(disk=100_000 * LAYOUT.nbytes)) as store:
        entries = store.entries(tier="disk")
        assert len(entries) >= 20 * 17 // 2  # most of the first 20 rounds reached the disk
        for entry in entries:
            block = store.read(entry.key)
            assert block is not None, f"{entry.key} is listed but does not verify"
        disk = store.stats()[-1]
        assert disk.corrupt == 0
        # Whole prompts of the earliest rounds are served, verified, from disk.
        prompt = [0] * 4 + list(range(64))
        assert store.fetch(make_namespace(), prompt + [1]).cached_tokens == 68
