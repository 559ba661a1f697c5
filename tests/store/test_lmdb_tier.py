"""The LMDB tier's own behaviour: a map reserved at its ceiling, evicting there, a bounded writer queue, sharing
with another process, and surviving SIGKILL."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from prefixgate.policies import make_policy
from prefixgate.store import Block, BlockLayout, Keep, chain_keys
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


def open_tier(path: Path, capacity_blocks: int, **sizes: int) -> LMDBTier:
    clock = FakeClock()
    policy = make_policy("lru", clock=clock)
    return LMDBTier(path, BIG, capacity_blocks * BIG.nbytes, policy, clock=clock, **sizes)


def test_the_map_is_reserved_at_its_ceiling_at_open_and_the_file_grows_only_as_written(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 3000)  # a 375 MiB budget
    assert tier._env.info()["map_size"] >= 3000 * BIG.nbytes
    assert (tmp_path / "data.mdb").stat().st_blocks * 512 < 1 << 20  # reserved address space, not disk
    tier.close()


def test_a_tier_filled_to_its_budget_serves_readers_in_other_threads_throughout(tmp_path: Path) -> None:
    capacity = 48
    tier = open_tier(tmp_path, capacity)
    map_size = tier._env.info()["map_size"]
    blocks = big_blocks(capacity + 16)
    read, written = blocks[:8], blocks[8:]
    for block in read:
        tier.put(block)
    tier.flush()
    started = [threading.Event() for _ in range(4)]
    stop = threading.Event()
    failures: list[str] = []

    def reader(started: threading.Event) -> None:
        while not stop.is_set():
            for block in read:
                got = tier.get(block.key, block.tokens)
                if got is None or not torch.equal(got.kv, block.kv):
                    failures.append(f"block {block.tokens[0] // 16} was not served whole")
            started.set()

    threads = [threading.Thread(target=reader, args=(event,)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        event.wait()  # every reader is reading before the writes begin
    for block in written[: capacity - len(read)]:  # up to the budget
        tier.put(block)
    for old, new in zip(written, written[capacity - len(read) :], strict=False):  # then churn at the budget
        tier.remove(old.key)
        tier.put(new)
    tier.flush()
    stop.set()
    for thread in threads:
        thread.join()
    assert failures == []
    assert len(tier) == capacity and tier.counters.evictions == 0
    assert all(tier.get(block.key, block.tokens) is not None for block in read + written[16:])
    assert tier._env.info()["map_size"] == map_size
    tier.close()


SHARER = """
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.store.test_lmdb_tier import big_blocks, open_tier
tier = open_tier(Path({path!r}), {capacity})
blocks = big_blocks({count})
print(sum(tier.get(block.key, block.tokens) is not None for block in blocks[:{theirs}]))
for block in blocks[{theirs}:]:
    tier.put(block)
tier.close()
"""


def test_two_processes_fill_one_store_to_near_its_budget_and_each_reads_the_others_blocks(tmp_path: Path) -> None:
    capacity, count, ours = 64, 60, 8
    tier = open_tier(tmp_path, capacity)
    map_size = tier._env.info()["map_size"]
    blocks = big_blocks(count)
    for block in blocks[:ours]:
        tier.put(block)
    tier.flush()
    script = SHARER.format(repo=str(REPO), path=str(tmp_path), capacity=capacity, count=count, theirs=ours)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == str(ours)  # the other process read every block this one wrote
    for block in blocks:  # and this one reads every block the other wrote
        got = tier.get(block.key, block.tokens)
        assert got is not None and torch.equal(got.kv, block.kv)
    assert len(tier) == count and tier._env.info()["map_size"] == map_size
    tier.close()


def test_a_writer_too_far_behind_drops_further_blocks_and_counts_them(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100, queue_bytes=2 * BIG.nbytes)
    blocks = big_blocks(4)
    with tier._env.begin(write=True):  # holds LMDB's write lock: the writer cannot commit anything yet
        assert [tier.put(block) for block in blocks] == [True, True, False, False]
        assert tier.counters.dropped_writes == 2
        assert tier.keys() == [blocks[0].key, blocks[1].key]
        assert tier.get(blocks[1].key, blocks[1].tokens) is not None  # queued blocks are served meanwhile
    tier.flush()
    assert tier.put(blocks[2])  # the writer caught up: room again
    tier.flush()
    assert [tier.get(block.key, block.tokens) is not None for block in blocks] == [True, True, True, False]
    assert tier.stats().dropped_writes == 2
    tier.close()


def test_a_map_at_its_ceiling_evicts_least_recently_used_blocks(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 100, map_bytes=2 << 20)  # a map smaller than the budget: full before the tier is
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
    tier = open_tier(tmp_path, 100, map_bytes=1 << 20)
    blocks = big_blocks(12)
    for block in blocks:
        tier.put(block, Keep(pinned=True))
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
        store.wait_for_writes()
        print("20 rounds on disk", flush=True)
    if round == 40:
        print("writing", flush=True)  # rounds 20 to 40 are queued: the writer thread is committing them
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
    assert child.stdout is not None and child.stdout.readline().strip() == "20 rounds on disk"
    assert child.stdout.readline().strip() == "writing"
    os.kill(child.pid, signal.SIGKILL)  # mid-stream, while the writer commits and the main thread queues more
    child.wait(timeout=30)

    with TieredStore.open(tmp_path, LAYOUT, config(disk=100_000 * LAYOUT.nbytes)) as store:
        entries = store.entries(tier="disk")
        assert len(entries) >= 20 * 17  # the first 20 rounds reached the disk, 17 blocks each
        for entry in entries:
            block = store.read(entry.key)
            assert block is not None, f"{entry.key} is listed but does not verify"
        disk = store.stats()[-1]
        assert disk.corrupt == 0
        # Whole prompts of the earliest rounds are served, verified, from disk.
        prompt = [0] * 4 + list(range(64))
        assert store.fetch(make_namespace(), prompt + [1]).cached_tokens == 68


REWRITER = """
import sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from tests.store.test_lmdb_tier import big_blocks, open_tier
tier = open_tier(Path({path!r}), 100, map_bytes={map_bytes})
block = big_blocks({count})[{index}]
tier.put(block)
tier.flush()
print(block.key in tier.keys())
tier.close()
"""


class PutOnFirstFallbackWarning(logging.Handler):
    """Put `block` from the writer thread when it first logs a write it could not fit, one op at a time."""

    def __init__(self, tier: LMDBTier, block: Block) -> None:
        super().__init__(logging.WARNING)
        self.tier, self.block = tier, block
        self.fired = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING and not self.fired.is_set():
            self.fired.set()
            self.tier.put(self.block)


def test_a_block_evicted_while_writing_one_at_a_time_is_served_once_another_process_rewrites_it(
    tmp_path: Path,
) -> None:
    map_bytes, count = 1 << 20, 20
    tier = open_tier(tmp_path, 100, map_bytes=map_bytes)
    blocks = big_blocks(count)
    filler, late, evicted = blocks[:12], blocks[12:15], blocks[15]
    for block in filler:  # more pinned blocks than the map holds: it ends full, with nothing to evict
        tier.put(block, Keep(pinned=True))
    tier.flush()
    held = tier.keys()
    assert 0 < len(held) < len(filler)
    # Pinned writes that cannot fit: at least two share a batch, which fails and is retried one at a time. After
    # the first of those fails, an unpinned block arrives (as another thread's put would), and the next retry
    # evicts it to make room.
    hook = PutOnFirstFallbackWarning(tier, evicted)
    logger = logging.getLogger("prefixgate.store.lmdb_tier")
    logger.addHandler(hook)
    try:
        # Holds LMDB's write lock: the writer commits nothing until all three are queued, so two share a batch.
        with tier._env.begin(write=True):
            for block in late:
                tier.put(block, Keep(pinned=True))
        tier.flush()
    finally:
        logger.removeHandler(hook)
    assert hook.fired.is_set() and tier.counters.evictions == 1
    assert tier.attrs(evicted.key) is None  # no longer held
    # Room for another process to write the evicted block. Two commits: LMDB reuses the pages a commit frees only
    # from the commit after next.
    for key in held[:2]:
        tier.remove(key)
        tier.flush()
    script = REWRITER.format(repo=str(REPO), path=str(tmp_path), map_bytes=map_bytes, count=count, index=15)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "True"  # the other process wrote it
    got = tier.get(evicted.key, evicted.tokens)
    assert got is not None and torch.equal(got.kv, evicted.kv)
    assert tier._unwritten == 0
    tier.close()


def damage(path: Path) -> None:
    """Overwrite 512 bytes in every 64 KiB of the data file, as a failing disk or a bad copy does."""
    data = path / "data.mdb"
    size = data.stat().st_size
    with data.open("r+b") as file:
        for offset in range(0, size, 64 << 10):
            file.seek(offset)
            file.write(os.urandom(512))


def test_a_damaged_store_is_set_aside_and_the_tier_opens_empty(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / "blocks.lmdb"
    tier = open_tier(path, 64)
    for block in big_blocks(40):
        tier.put(block)
    tier.close()
    damage(path)
    clock = FakeClock()
    with caplog.at_level(logging.WARNING):
        reopened = LMDBTier.open(path, BIG, 64 * BIG.nbytes, make_policy("lru", clock=clock), clock=clock)
    try:
        (aside,) = [entry for entry in tmp_path.iterdir() if entry.name.startswith("blocks.lmdb.damaged-")]
        assert (aside / "data.mdb").stat().st_size > 0  # kept, for whoever wants to look at it
        assert len(reopened) == 0 and reopened.counters.set_aside == 1 and reopened.problem is None
        assert f"set aside as {aside}" in caplog.text and "delete" in caplog.text
        block = big_blocks(1)[0]
        assert reopened.put(block)
        reopened.flush()
        got = reopened.get(block.key, block.tokens)
        assert got is not None and torch.equal(got.kv, block.kv)
    finally:
        reopened.close()


def test_a_tier_whose_reads_or_writes_fail_is_out_of_the_path_until_its_backoff_then_works_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    clock = FakeClock()
    tier = LMDBTier(tmp_path, BIG, 64 * BIG.nbytes, make_policy("lru", clock=clock), clock=clock)
    blocks = big_blocks(4)
    tier.put(blocks[0])
    tier.flush()
    begin = tier._begin

    def broken(*, write: bool = False) -> Any:
        raise lmdb.Error("mdb_txn_begin: Input/output error")

    monkeypatch.setattr(tier, "_begin", broken)
    with caplog.at_level(logging.WARNING):
        assert tier.get(blocks[0].key, blocks[0].tokens) is None  # a miss, not an error
        assert tier.problem == "reads fail: mdb_txn_begin: Input/output error"
        assert tier.get(blocks[0].key, blocks[0].tokens) is None  # out of the path: not even tried
        assert not tier.put(blocks[1])  # nor written to
    assert tier.counters.failed_reads == 1 and tier.counters.failed_writes == 1
    assert caplog.text.count("fail (mdb_txn_begin") == 1  # said once, not at every request

    monkeypatch.setattr(tier, "_begin", begin)
    clock.advance(1.0)  # the first backoff is over: the next read is a try, and it works
    got = tier.get(blocks[0].key, blocks[0].tokens)
    assert got is not None and tier.problem is None

    def full(batch: Any) -> None:
        raise lmdb.Error("mdb_txn_commit: No space left on device")

    monkeypatch.setattr(tier, "_commit", full)
    assert tier.put(blocks[2])  # queued: the writer finds out
    tier.flush()
    assert tier.problem == "writes fail: mdb_txn_commit: No space left on device"
    assert tier.counters.failed_writes == 2 and tier.get(blocks[2].key, blocks[2].tokens) is None
    monkeypatch.undo()
    clock.advance(2.0)  # the second failure in a row doubled the backoff
    assert tier.put(blocks[3])
    tier.flush()
    assert tier.problem is None and tier.get(blocks[3].key, blocks[3].tokens) is not None
    tier.close()
