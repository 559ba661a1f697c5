"""The disk tier: blocks in LMDB, surviving restarts and shared by processes on one machine."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lmdb
import torch

from prefixgate.errors import StoreError
from prefixgate.policies import Policy
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep
from prefixgate.store.codec import BlockHeader, CorruptBlockError, decode, encode, read_header
from prefixgate.store.keys import BlockKey
from prefixgate.store.tier import EntryInfo, Held, Tier, TierHealth

log = logging.getLogger(__name__)

_PAGE = 4096
_MIN_MAP_BYTES = 64 << 20
_BATCH = 64  # operations per write transaction: one fsync for many blocks
_QUEUE_BYTES = 256 << 20  # tensor bytes that may wait for the writer; beyond it, write-throughs are dropped
_BACKOFF = 1.0  # seconds a failing tier is out of the path, doubling with each failure to _MAX_BACKOFF
_MAX_BACKOFF = 60.0


@dataclass(frozen=True, slots=True)
class _Put:
    block: Block
    keep: Keep


@dataclass(frozen=True, slots=True)
class _Delete:
    keys: tuple[BlockKey, ...]


_Op = _Put | _Delete | None  # None stops the writer


class LMDBTier(Tier):
    """Blocks as LMDB values (msgpack header + raw tensor bytes), written by one background thread.

    Reads run in the caller's thread (the store is never called on the event loop); every write goes through
    the writer thread, in batches, so inserts never wait for the disk. A block is visible to `get` from the
    moment `put` returns. At most `queue_bytes` of blocks wait for the writer; a `put` beyond that is dropped
    and counted. The map is reserved once, at its ceiling; when it is full, the tier evicts by policy.

    The tier's own blocks are those of its layout: the only blocks it lists, evicts and clears. Blocks of other
    layouts in the same database belong to other models sharing the folder.
    """

    persistent = True

    def __init__(
        self,
        path: Path,
        layout: BlockLayout,
        capacity_bytes: int,
        policy: Policy,
        *,
        clock: Callable[[], float],
        name: str = "disk",
        map_bytes: int | None = None,
        queue_bytes: int = _QUEUE_BYTES,
    ) -> None:
        super().__init__(name, layout, capacity_bytes, policy, clock)
        self.path = path
        # Values take whole overflow pages; the ceiling leaves room for that and LMDB's own pages.
        value_pages = -(-(layout.nbytes + 1024) // _PAGE) + 1
        ceiling = self.capacity_blocks * value_pages * _PAGE * 5 // 4 + _MIN_MAP_BYTES
        # Token ids are every tenant's prompts: the folder and files are their owner's alone.
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The map is opened at its ceiling and never resized: LMDB resizes safely only while no transaction of
        # the process is open, and does not check, while readers here run in any thread at any time. Reserving
        # the ceiling costs address space, not disk: the file grows only as pages are written (sparse on Linux).
        # Processes sharing the folder with the same disk budget reserve the same map, so none outgrows another.
        self._env = lmdb.open(
            str(path),
            map_size=map_bytes or ceiling,
            subdir=True,
            mode=0o600,
            readahead=False,  # random block reads; readahead only pollutes the page cache
            max_readers=512,
        )
        self._lock = threading.RLock()
        self._index: Held[BlockHeader] = Held(lambda header: len(header.tokens) == layout.block_size)
        # Writes queued but not yet committed: a _Put is served from here, a _Delete hides what is on disk.
        self._pending: dict[BlockKey, _Put | _Delete] = {}
        # Blocks queued and not yet written hold their tensors (on a GPU, device memory): at most this many.
        self._max_unwritten = max(1, queue_bytes // layout.nbytes)
        self._unwritten = 0
        self._queue: queue.Queue[_Op] = queue.Queue()
        self._health = TierHealth(clock, _BACKOFF, _MAX_BACKOFF)
        try:
            self._load_index()
        except BaseException:
            self._env.close()
            raise
        self._writer = threading.Thread(target=self._write_loop, name=f"prefixgate-{name}-writer", daemon=True)
        self._writer.start()

    @classmethod
    def open(
        cls,
        path: Path,
        layout: BlockLayout,
        capacity_bytes: int,
        policy: Policy,
        *,
        clock: Callable[[], float],
        **options: Any,
    ) -> LMDBTier:
        """Open the tier at `path`; a store that cannot be opened or read because it is damaged (a failing disk, a
        bad copy) is set aside, renamed beside itself with the time, and an empty one opened in its place.

        Everything in it is a cache: losing it costs recomputation, while refusing to start would cost the service.
        """
        try:
            return cls(path, layout, capacity_bytes, policy, clock=clock, **options)
        except lmdb.Error as error:
            aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            path.rename(aside)
            log.warning(
                "the disk tier at %s cannot be read (%s): it was set aside as %s, and the server starts with an "
                "empty disk tier. Everything in it was a cache; delete %s once it is of no more use.",
                path,
                error,
                aside,
                aside,
            )
        tier = cls(path, layout, capacity_bytes, policy, clock=clock, **options)
        tier.counters.add("set_aside")
        return tier

    # -- Tier ---------------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._adopt(key) is not None

    def get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor | None = None) -> Block | None:
        if not self._health.usable():
            return None  # failing: a miss until its backoff is over
        try:
            block = self._get(key, tokens, out)
        except lmdb.Error as error:
            self._failed("reads", error)
            return None
        self._worked()
        return block

    def _get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor | None) -> Block | None:
        with self._lock:
            pending = self._pending.get(key)
        if isinstance(pending, _Delete):
            return None
        if pending is not None:
            block = pending.block
            if block.tokens != tuple(tokens):
                self._drop_corrupt(key, "tokens differ")
                return None
            self.touch(key)
            return replace(block, kv=block.kv.clone() if out is None else out.copy_(block.kv))
        try:
            with self._begin() as txn:
                value = txn.get(key.digest)
                if value is None:
                    self._forget(key)  # removed by another process
                    return None
                block, header = decode(key, value, self.layout, out)
        except CorruptBlockError as error:
            self._drop_corrupt(key, str(error))
            return None
        if block.tokens != tuple(tokens):
            self._drop_corrupt(key, "tokens differ")
            return None
        with self._lock:
            if key not in self._index:
                self._register(key, header)
            self.policy.touch(key)
        return block

    def peek(self, key: BlockKey) -> Block | None:
        # A look, as inspection and explain take: no policy touch, no hit, nothing registered or dropped.
        with self._lock:
            header = self._index.get(key)
            pending = self._pending.get(key)
        if header is None:
            return None
        if isinstance(pending, _Put):
            return pending.block
        try:
            with self._begin() as txn:
                value = txn.get(key.digest)
                return None if value is None else decode(key, value, self.layout)[0]
        except (CorruptBlockError, lmdb.Error):
            return None  # the next `get` drops and counts it

    def attrs(self, key: BlockKey) -> Keep | None:
        with self._lock:
            header = self._index.get(key)
        return None if header is None else header.keep

    def retain(self, key: BlockKey, until: float) -> bool:
        # Kept in the index and the policy, not rewritten on disk: a rewrite is the whole block, and a retention
        # refreshed on every hit would write it each time. The stored one (from its last write) holds after a restart.
        with self._lock:
            header = self._index.get(key)
            if header is None:
                return False
            self._index.set(key, header.parent, replace(header, keep=header.keep.merged(Keep(retain_until=until))))
            self._retain(key, until)
        return True

    def touch(self, key: BlockKey) -> None:
        with self._lock:
            self.policy.touch(key)

    def victim(self) -> BlockKey | None:
        with self._lock:
            return super().victim()

    def expired(self) -> list[BlockKey]:
        with self._lock:
            return super().expired()

    def put(self, block: Block, keep: Keep = BY_POLICY) -> bool:
        self.layout.check(block)
        if not self._health.usable():
            self.counters.add("failed_writes")  # failing: not even queued until its backoff is over
            return False
        with self._lock:
            if self._unwritten >= self._max_unwritten:
                # Dropped rather than waited for: the caller holds the store's lock, so waiting for the disk would
                # stall every lookup and fetch, and the blocks would only pile up in front of the store instead,
                # their tensors still held. The block stays in its memory tier; only its disk copy is skipped.
                self.counters.add("dropped_writes")
                return False
            self._enqueue(_Put(block, keep))
        return True

    def remove(self, key: BlockKey) -> bool:
        op = _Delete((key,))
        with self._lock:
            held = self._index.pop(key) is not None
            self._pending[key] = op
            self.policy.remove(key)
            self._queue.put(op)
        return held

    def pin(self, key: BlockKey, pinned: bool) -> bool:
        block, attrs = self.peek(key), self.attrs(key)
        if block is None or attrs is None:
            return False
        # Rewritten through the writer, so the pin survives a restart like everything else on disk. Queued even
        # when the writer is behind: a pin is an operator's request, rare and small next to write-throughs.
        with self._lock:
            self._enqueue(_Put(block, replace(attrs, pinned=pinned)))
        return True

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    def children(
        self, parent: BlockKey, *, newest: int | None = None, whole: bool = False
    ) -> list[tuple[BlockKey, tuple[int, ...]]]:
        # Only blocks this process has registered: another process's block is adopted when a lookup first asks for
        # its key, so a child another process wrote is found after its own chain was looked up here once.
        with self._lock:
            found = [(key, self._index.get(key)) for key in self._index.children(parent, newest=newest, whole=whole)]
        return [(key, header.tokens) for key, header in found if header is not None]

    def entry(self, key: BlockKey) -> EntryInfo | None:
        with self._lock:
            header = self._index.get(key)
            times = self.policy.info(key)
        if header is None or times is None:
            return None
        return EntryInfo(
            key=key,
            tier=self.name,
            tokens=len(header.tokens),
            nbytes=header.nbytes,
            tenant=header.tenant,
            parent=header.parent,
            created=header.created,
            last_access=times.last_access,
            expires_at=times.expires_at,
            hits=times.hits,
            pinned=header.keep.pinned,
            retained_until=times.retained_until,
        )

    def clear(self) -> int:
        # Deletes exactly the blocks this tier holds, never the whole database: other models' blocks, and those
        # other processes wrote since this one last looked, share it.
        with self._lock:
            op = _Delete(tuple(self._index))
            for key in op.keys:
                self.policy.remove(key)
                self._pending[key] = op
            self._index.clear()
            self._queue.put(op)
        return len(op.keys)

    def flush(self) -> None:
        """Wait until every write so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            self._env.close()

    # -- reading ------------------------------------------------------------------------------------------------

    def _begin(self, *, write: bool = False) -> lmdb.Transaction:
        try:
            return self._env.begin(write=write, buffers=True)
        except lmdb.MapResizedError as error:
            # Only a process that reserved a larger map can outgrow this one, which is never resized (see __init__).
            raise StoreError(
                f"another process opened {self.path} with a larger disk budget and its blocks outgrew this "
                "process's map; give every process that shares the store folder the same disk budget"
            ) from error

    def _load_index(self) -> None:
        found: list[tuple[BlockKey, BlockHeader]] = []
        broken: list[bytes] = []
        with self._begin() as txn:
            for raw_key, value in txn.cursor():
                key_bytes = bytes(raw_key)
                if len(key_bytes) != 16:
                    continue  # not a block of ours
                try:
                    header, _ = read_header(value)
                except CorruptBlockError:
                    broken.append(key_bytes)
                    continue
                # Blocks of another layout belong to another model sharing this folder: theirs to manage.
                if self._fits(header):
                    found.append((BlockKey(key_bytes), header))
        # Oldest first, so the policy's order starts as the order of creation.
        for key, header in sorted(found, key=lambda item: item[1].created):
            self._register(key, header)
        if broken:
            self.counters.add("corrupt", len(broken))
            self._queue.put(_Delete(tuple(BlockKey(key_bytes) for key_bytes in broken)))
            log.warning("dropped %d unreadable blocks from %s", len(broken), self.path)

    def _adopt(self, key: BlockKey) -> BlockHeader | None:
        """Register a block another process wrote, so this one serves and evicts it too."""
        with self._lock:
            if key in self._pending:
                return None  # this process is writing or deleting it
        if not self._health.usable():
            return None
        try:
            with self._begin() as txn:
                value = txn.get(key.digest)
                if value is None:
                    return None
                try:
                    header, _ = read_header(value)
                except CorruptBlockError as error:
                    self._drop_corrupt(key, str(error))
                    return None
        except lmdb.Error as error:
            self._failed("reads", error)
            return None
        if not self._fits(header):
            return None
        with self._lock:
            if key not in self._index:
                self._register(key, header)
        return header

    def _register(self, key: BlockKey, header: BlockHeader) -> None:
        self._index.set(key, header.parent, header)
        self._track(key, header.created, header.keep)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            if key in self._index and key not in self._pending:
                self._index.pop(key)
                self.policy.remove(key)

    def _failed(self, what: str, error: Exception) -> None:
        """Count a failed read or write; the first of a run says so in the log and in `problem`, and takes the tier
        out of the path for its backoff."""
        if what == "reads":
            self.counters.add("failed_reads")
        delay = self._health.failed()
        if delay is None:
            return  # a failure already recorded, from before the tier was marked down
        if self.problem is None:
            log.warning(
                "%s of the %s tier at %s fail (%s): it is out of the path, tried again in %g s",
                what,
                self.name,
                self.path,
                error,
                delay,
            )
        self.problem = f"{what} fail: {error}"

    def _worked(self) -> None:
        if self._health.succeeded():
            log.info("the %s tier at %s works again", self.name, self.path)
            self.problem = None

    def _drop_corrupt(self, key: BlockKey, why: str) -> None:
        log.warning("dropping corrupt block %s from %s: %s", key.hex(), self.name, why)
        self.counters.add("corrupt")
        self.remove(key)

    def _fits(self, header: BlockHeader) -> bool:
        return header.shape == self.layout.shape and header.dtype == self.layout.dtype_name

    def _enqueue(self, op: _Put) -> None:
        """Queue a block for the writer, serving it from memory meanwhile; the caller holds the lock."""
        self._index.set(op.block.key, op.block.parent, self._header_of(op))
        self._pending[op.block.key] = op
        self._track(op.block.key, op.block.created, op.keep)
        self._unwritten += 1
        self._queue.put(op)

    def _header_of(self, op: _Put) -> BlockHeader:
        block = op.block
        return BlockHeader(
            dtype=self.layout.dtype_name,
            shape=self.layout.shape,
            tokens=block.tokens,
            checksum=0,  # computed when the writer encodes it
            parent=block.parent,
            tenant=block.tenant,
            created=block.created,
            keep=op.keep,
            nbytes=self.layout.nbytes,
        )

    # -- writing ------------------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            ops = [op for op in batch if op is not None]
            queued = sum(isinstance(op, _Put) for op in ops)  # counted before a full map turns some into deletes
            landed: list[_Put | _Delete] = []
            try:
                landed = self._write(ops)
                if landed:
                    self._worked()
            except Exception as error:  # the writer must outlive any one bad batch, or every later write is lost
                self.counters.add("failed_writes", queued)
                self._failed("writes", error)
            finally:
                self._settle(ops, landed, queued)
                for _ in batch:
                    self._queue.task_done()
            if len(ops) < len(batch):
                return

    def _write(self, batch: list[_Put | _Delete]) -> list[_Put | _Delete]:
        """Commit the batch in one transaction; when it cannot fit, commit what fits one by one.

        Evictions made to fit are added to `batch`, landed or not, so `_settle` retires their pending marks too.
        """
        try:
            self._commit(batch)
            return batch
        except StoreError:
            if len(batch) == 1:
                raise
        landed = []
        for op in list(batch):
            attempt = [op]  # `_commit` adds its evictions here, and drops `op` if its own block is the victim
            try:
                self._commit(attempt)
                landed.extend(attempt)
            except StoreError as error:
                log.warning("%s", error)
            finally:
                batch.extend(added for added in attempt if added is not op)
        return landed

    def _commit(self, batch: list[_Put | _Delete]) -> None:
        values = {id(op): encode(op.block, op.keep) for op in batch if isinstance(op, _Put)}
        while True:
            try:
                with self._begin(write=True) as txn:
                    for op in batch:
                        if isinstance(op, _Put):
                            txn.put(op.block.key.digest, values[id(op)])
                        else:
                            for key in op.keys:
                                txn.delete(key.digest)
                return
            except lmdb.MapFullError as error:
                if not self._evict_one(batch):
                    raise StoreError(
                        f"{self.path} is full of pinned blocks; a block was not written. "
                        "Unpin some blocks or raise the disk budget"
                    ) from error

    def _settle(self, batch: list[_Put | _Delete], landed: list[_Put | _Delete], queued: int) -> None:
        """Retire a batch's pending marks and its `queued` blocks; forget blocks that never reached the disk."""
        landed_ids = {id(op) for op in landed}
        with self._lock:
            self._unwritten -= queued
            for op in batch:
                for key in (op.block.key,) if isinstance(op, _Put) else op.keys:
                    if self._pending.get(key) is op:
                        del self._pending[key]
                        if isinstance(op, _Put) and id(op) not in landed_ids:
                            self._index.pop(key)
                            self.policy.remove(key)

    def _evict_one(self, batch: list[_Put | _Delete]) -> bool:
        """Make room in a map at its ceiling: delete the policy's victim in the same transaction."""
        with self._lock:
            victim = self.victim()
            if victim is None:
                return False
            self._index.pop(victim)
            delete = self._pending[victim] = _Delete((victim,))
            self.policy.remove(victim)
        self.counters.add("evictions")
        batch[:] = [
            delete,
            *(op for op in batch if not (isinstance(op, _Put) and op.block.key == victim)),
        ]
        return True
