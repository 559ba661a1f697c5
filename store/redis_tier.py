"""The Redis tier: blocks in Redis (or Valkey) below the disk tier, shared by every replica pointed at it.

It stands beside `Tier`, not under it. A `Tier` holds blocks within a byte budget it never exceeds, lists them, and
lets its policy choose victims that the store then demotes. None of that fits Redis: it holds prefixgate's blocks
among other data, under its own `maxmemory` and eviction policy, and replicas come and go while sharing it, so no
replica could keep an order of its keys that the others agree with, and listing them is a full SCAN. So this tier
does what Redis does well and nothing else: a chain of blocks streamed in one round trip, write-through in the
background, deletes, and a flush. Expiry is Redis's own: every block is written with a TTL.

Faults never reach callers. A connection error or timeout answers a miss, counts in `errors`, and marks the tier
unavailable; until its backoff is over (doubling with each failed try, on the injected clock) it answers misses and
drops writes without touching the network, so a dead Redis costs a lookup nothing. The one exception is
`load_or_create_secret`, called once at startup: a replica that cannot read the shared secret would key its blocks
apart from the others and share nothing, silently.

Operators: give Redis `maxmemory-policy volatile-lru` (or another `volatile-*`): every block carries a TTL and the
shared secret does not, so Redis evicts blocks and never the secret. Under `noeviction`, writes past `maxmemory` are
refused; they are dropped and counted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError
from redis.retry import Retry

from prefixgate.errors import ConfigError, StoreError
from prefixgate.store.block import BY_POLICY, Block, BlockLayout, Keep
from prefixgate.store.codec import CorruptBlockError, decode, encode
from prefixgate.store.keys import BlockKey
from prefixgate.store.redis_stream import CommandStream, OversizeValue, ReplyError
from prefixgate.store.tier import TierCounters, TierHealth
from prefixgate.threads import use_threads
from prefixgate.urls import masked_url

log = logging.getLogger(__name__)

KEY_PREFIX = "prefixgate:block:"  # every block key starts with it, so a flush touches only prefixgate's blocks
NEXT_PREFIX = "prefixgate:next:"  # a block's list of the blocks written after it: its key and token ids, newest first
SECRET_KEY = "prefixgate:secret"  # outside both prefixes: a flush keeps it
NEXT_BLOCKS = 32  # entries kept in each list of blocks written after a block
DEFAULT_TTL = 24 * 3600.0
DEFAULT_SOCKET_TIMEOUT = 0.25
DEFAULT_WRITE_TIMEOUT = 5.0
_SECRET_BYTES = 32
DEFAULT_QUEUE_BYTES = 256 << 20  # tensor bytes that may wait for the writer; beyond it, write-throughs are dropped
_BATCH_OPS = 64  # operations per pipeline
_BATCH_BYTES = 16 << 20  # tensor bytes per pipeline: each is encoded in memory before it is sent
_AHEAD_BYTES = 4 << 20  # blocks a chain read asks for ahead of the one it reads: enough to keep the link busy
_HEADER_BYTES = 64 << 10  # room for a value's header in the buffer a block is read into; a larger value is corrupt
_SCAN_COUNT = 1000  # keys per SCAN step, and per UNLINK


@dataclass(slots=True)
class RedisCounters(TierCounters):
    """The tier counters, plus what only a networked tier has."""

    errors: int = 0  # failed round trips: connection errors, timeouts, replies other than OOM
    round_trips: int = 0  # reads: each waits one round trip for its first reply, and its commands keep the link busy
    writes: int = 0  # blocks Redis accepted
    written_bytes: int = 0  # their encoded bytes


@dataclass(frozen=True, slots=True)
class RedisStats:
    """A snapshot of the Redis tier's state and counters; for what Redis holds see `RedisTier.usage`."""

    name: str
    url: str  # with its password masked
    available: bool
    hits: int
    misses: int
    promotions: int
    corrupt: int
    dropped_writes: int  # writer too far behind, Redis unavailable, or Redis out of memory
    errors: int
    round_trips: int  # of reads
    writes: int
    written_bytes: int
    queued_bytes: int  # tensor bytes waiting for the writer now


@dataclass(frozen=True, slots=True)
class RedisUsage:
    """What Redis holds, read from it: prefixgate's blocks, of every model and tenant, and its memory."""

    entries: int
    used_memory: int  # bytes of everything Redis holds, summed over a cluster's primaries
    maxmemory: int  # its limit; 0: none
    maxmemory_policy: str


@dataclass(frozen=True, slots=True)
class RemoteBlock:
    """One verified block of a chain read, with how it was kept when written."""

    block: Block
    keep: Keep


Continuation = tuple[BlockKey, tuple[int, ...]]
"""A block listed after another in Redis: its key and token ids."""


@dataclass(frozen=True, slots=True)
class RemoteRun:
    """The leading run of a chain in Redis, and the blocks listed after its last block, read in the same round trip."""

    run: int  # blocks held (by `present`), or found and verified (by `get_chain`)
    blocks: list[RemoteBlock]  # the verified blocks, from `get_chain`
    following: list[Continuation]  # listed after the run's last block (or after `parent` when the run is empty)


@dataclass(frozen=True, slots=True)
class _Put:
    block: Block
    keep: Keep


@dataclass(frozen=True, slots=True)
class _Delete:
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class _Retain:
    keys: tuple[BlockKey, ...]
    until: float


_Op = _Put | _Delete | _Retain | None  # None stops the writer


class RedisTier:
    """Blocks in Redis as codec values under `prefixgate:block:<key hex>`, each expiring by its own TTL.

    Reads run in the caller's thread, one round trip each (a chain's blocks stream, see `get_chain`). Writes go
    through one background thread, pipelined in batches: a block is visible to readers once the writer has sent it
    (`flush` waits for that). At most `queue_bytes` of blocks wait for the writer; a `put` beyond that is dropped
    and counted.

    `stats` is cheap and makes no round trip, so it reports no number of blocks: Redis expires and evicts them on
    its own, so no count kept here stays true, and DBSIZE counts every key of the database, not prefixgate's.
    `usage` gives the true number on demand, with a SCAN of the whole database.
    """

    def __init__(
        self,
        urls: tuple[str, ...],
        layout: BlockLayout,
        *,
        name: str = "remote",
        ttl: float = DEFAULT_TTL,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        queue_bytes: int = DEFAULT_QUEUE_BYTES,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.url = ", ".join(masked_url(url) for url in urls)
        if not urls or any(urlsplit(url).scheme not in ("redis", "rediss") for url in urls):
            raise ConfigError(f"a Redis URL starts with redis:// (or rediss:// for TLS), got {self.url!r}")
        if ttl <= 0 or socket_timeout <= 0 or write_timeout <= 0 or backoff <= 0 or max_backoff < backoff:
            raise ConfigError(
                "the Redis tier's ttl, timeouts and backoff must be positive, with max_backoff at least backoff; "
                f"got ttl={ttl}, socket_timeout={socket_timeout}, write_timeout={write_timeout}, "
                f"backoff={backoff}, max_backoff={max_backoff}"
            )
        self.name = name
        self.layout = layout
        self.ttl = ttl
        self.counters = RedisCounters()
        self._clock = clock  # in the time base of `Block.created`; also times the backoff
        self._health = TierHealth(clock, backoff, max_backoff)
        self._secret: bytes | None = None  # once read: put back if Redis loses it
        self._secret_conflict = False  # Redis holds another secret (logged once)
        # Two clients: lookups wait at most `socket_timeout`, so a dead Redis answers a miss fast; the writer sends
        # whole blocks, which take longer than that on a slow link, and nobody waits for it.
        self._reader = _client(urls, socket_timeout, socket_timeout)
        self._slots_stale = False  # a cluster's map of slots to nodes: read it again before the next read
        self._value_bytes = layout.nbytes + _HEADER_BYTES + 2  # a block's value and its reply's CRLF
        self._writer_client = _client(urls, socket_timeout, write_timeout)
        self._lock = threading.Lock()
        # Blocks queued and not yet sent hold their tensors (on a GPU, device memory): at most this many.
        self._max_queued = max(1, queue_bytes // layout.nbytes)
        self._queued = 0
        self._queue: queue.Queue[_Op] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name=f"prefixgate-{name}-writer", daemon=True)
        self._writer.start()

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, name={self.name!r})"

    @property
    def available(self) -> bool:
        """Return whether Redis answered the last time the tier asked it."""
        return self._health.available

    # -- reading ------------------------------------------------------------------------------------------------

    def get_chain(
        self,
        keys: Sequence[BlockKey],
        tokens: Sequence[int],
        out: torch.Tensor | None = None,
        *,
        parent: BlockKey | None = None,
    ) -> RemoteRun:
        """Return the leading run of `keys` held in Redis, verified against `tokens`, and what is listed after it.

        `parent` is the block before `keys[0]`, if any. The lists of blocks written after each block asked for (and
        after `parent`) come in the same round trip, so finding the block that continues the run costs none more.

        `tokens` are the token ids the keys cover, `block_size` per key. Block `i` is copied into
        `out[:, :, :, i * block_size : (i + 1) * block_size]` when `out` is given (`[layers, 2, kv_heads, tokens,
        head_dim]`, as `TieredStore.fetch` lends it), so each returned tensor is a view into it. The run ends at the
        first block missing or failing verification; a failing one is deleted from Redis and counted as corrupt.

        The blocks stream: `_AHEAD_BYTES` of them are asked for beyond the one being read, the next as each is read,
        so the read waits one round trip for its first block and none after, while Redis builds each reply as the
        one before it leaves (a pipeline of every block would have Redis build them all in its memory first: at 4k
        tokens nearly three times slower here). Each value is read into one reused buffer, verified there and copied
        into place.
        """
        size = self.layout.block_size
        if len(tokens) < len(keys) * size or (out is not None and out.shape[3] < len(keys) * size):
            raise RuntimeError(f"get_chain needs tokens, and an out, covering {len(keys)} blocks of {size} tokens")
        asked = [*([parent] if parent is not None else []), *keys]
        ahead = max(1, _AHEAD_BYTES // self.layout.nbytes)  # blocks asked for beyond the one being read
        found: list[RemoteBlock] = []
        lists: dict[BlockKey, list[Continuation]] = {}

        def read(stream: CommandStream) -> None:
            for command in _lranges(asked):
                stream.send(*command)
            for key in keys[:ahead]:
                stream.send("GET", _redis_key(key))
            lists.update({key: self._continuations(stream.read()) for key in asked})
            buffer = bytearray(self._value_bytes)
            for index, key in enumerate(keys):
                if index + ahead < len(keys):  # on its way while this block arrives: the link never idles
                    stream.send("GET", _redis_key(keys[index + ahead]))
                value = stream.read_into(buffer)
                span = slice(index * size, (index + 1) * size)
                block = self._verified(key, value, tokens[span], out[:, :, :, span] if out is not None else None)
                if block is None:
                    return
                found.append(block)

        self._talk(read)
        self.counters.add("hits", len(found))
        if len(found) < len(keys):
            self.counters.add("misses")
        last = found[-1].block.key if found else parent
        return RemoteRun(len(found), found, lists.get(last, []) if last is not None else [])

    def present(self, keys: Sequence[BlockKey], *, parent: BlockKey | None = None) -> RemoteRun:
        """Return how many leading `keys` Redis holds, and what is listed after them, in one round trip reading no
        block.

        Unverified, as a local tier's `contains` is: a lookup's estimate, which `get_chain` confirms. `parent` is the
        block before `keys[0]`, if any.
        """
        asked = [*([parent] if parent is not None else []), *keys]
        replies = self._ask([("EXISTS", _redis_key(key)) for key in keys] + _lranges(asked))
        if replies is None:
            return RemoteRun(0, [], [])
        run = 0
        while run < len(keys) and replies[run] == 1:
            run += 1
        last = keys[run - 1] if run else parent
        lists = dict(zip(asked, replies[len(keys) :], strict=True))
        return RemoteRun(run, [], self._continuations(lists[last]) if last is not None else [])

    def continuations(self, parent: BlockKey) -> list[Continuation]:
        """Return the blocks last written after `parent` (by any replica), with their token ids, the newest last.

        One round trip, reading no block. Unverified: a listed block may have expired or been evicted since;
        `get_block` confirms it.
        """
        replies = self._ask(_lranges([parent]))
        return self._continuations(replies[0] if replies is not None else None)

    def get_block(self, key: BlockKey, tokens: Sequence[int]) -> Block | None:
        """Return one block read from Redis, verified (checksum, and its leading token ids equal to `tokens`).

        A block that fails verification is deleted and counted as corrupt; one that is gone is None.
        """
        found: list[RemoteBlock] = []

        def read(stream: CommandStream) -> None:
            stream.send("GET", _redis_key(key))
            block = self._verified(key, stream.read_into(bytearray(self._value_bytes)), tokens)
            if block is not None:
                found.append(block)

        self._talk(read)
        return found[0].block if found else None

    def check(self) -> bool:
        """Return whether Redis answers now; within the backoff after a failure, False without asking.

        For health checks: requests served from the local tiers alone never ask Redis, so only this notices that it
        went away, or came back, or lost the shared secret (which it puts back).
        """
        if not self._health.usable():
            return False
        try:
            if self._secret is None:
                self._reader.ping()
            else:
                self._keep_secret()
        except (RedisError, OSError) as error:
            self._fault(error)
            return False
        self._answered()
        return True

    def usage(self) -> RedisUsage | None:
        """Return what Redis holds now, or None when it does not answer.

        A SCAN of the whole database, as long as the database is big: for an operator's look, not for a dashboard
        that refreshes every second.
        """
        if not self._health.usable():
            return None
        client = self._writer_client
        try:
            entries = sum(1 for _ in client.scan_iter(match=f"{KEY_PREFIX}*", count=_SCAN_COUNT))
            if isinstance(client, RedisCluster):
                replies = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                memory = list(cast(dict[str, dict[str, Any]], replies).values())
            else:
                memory = [client.info("memory")]
        except (RedisError, OSError) as error:
            self._fault(error)
            return None
        self._answered()
        return RedisUsage(
            entries=entries,
            used_memory=sum(int(node["used_memory"]) for node in memory),
            maxmemory=sum(int(node["maxmemory"]) for node in memory),
            maxmemory_policy=str(memory[0]["maxmemory_policy"]),
        )

    def load_or_create_secret(self) -> bytes:
        """Return the deployment secret kept in Redis, creating it once, so every replica keys blocks alike.

        Raise StoreError when Redis does not answer or holds a damaged secret.
        """
        # SET NX: of replicas starting at once, exactly one creates it, and every one then reads the same bytes.
        try:
            self._writer_client.set(SECRET_KEY, os.urandom(_SECRET_BYTES), nx=True)
            secret = self._writer_client.get(SECRET_KEY)
        except (RedisError, OSError) as error:
            raise StoreError(
                f"cannot read the shared secret {SECRET_KEY!r} from Redis at {self.url} ({error}); "
                "check that Redis runs and the URL is right"
            ) from error
        if not isinstance(secret, bytes) or len(secret) != _SECRET_BYTES:
            length = len(secret) if isinstance(secret, bytes) else 0
            raise StoreError(
                f"{SECRET_KEY!r} in Redis at {self.url} is damaged ({length} bytes, expected {_SECRET_BYTES}); "
                "delete it to reset (every replica then keys its blocks anew)"
            )
        self._secret = secret
        return secret

    def _talk(self, conversation: Callable[[CommandStream], None]) -> None:
        """Run `conversation` on a stream of commands to Redis; a fault ends it early and is counted.

        Nothing is asked while Redis is marked unavailable. After a fault or a cluster's MOVED reply, the cluster's
        map of slots to nodes is read again before the next conversation.
        """
        if not self._health.usable():
            return
        stream = CommandStream(self._reader)
        self.counters.add("round_trips")
        try:
            if self._slots_stale and isinstance(self._reader, RedisCluster):
                self._reader.nodes_manager.initialize()
            self._slots_stale = False
            with stream:
                conversation(stream)
        # RedisClusterException: no node serves a key's slot, or no node of the cluster answers.
        except (RedisError, RedisClusterException, OSError) as error:
            self._fault(error)
            return
        finally:
            self._slots_stale |= stream.moved
        self._answered()

    def _ask(self, commands: Sequence[tuple[Any, ...]]) -> list[object] | None:
        """Send `(command, key, *args)` commands at once; return their small replies, or None when Redis did not
        answer."""
        replies: list[object] = []

        def ask(stream: CommandStream) -> None:
            for command in commands:
                stream.send(*command)
            replies.extend(stream.read() for _ in commands)

        self._talk(ask)
        return replies if len(replies) == len(commands) else None

    def _verified(
        self,
        key: BlockKey,
        value: memoryview | ReplyError | None,
        tokens: Sequence[int],
        out: torch.Tensor | None = None,
    ) -> RemoteBlock | None:
        """Return the block in a GET reply, verified and copied into `out` when given; None when it is not there,
        its node did not answer it, or it fails verification (then it is deleted and counted corrupt)."""
        if isinstance(value, OversizeValue):
            self._drop_corrupt(key, str(value))
        if not isinstance(value, memoryview):
            return None
        try:
            block, header = decode(key, value, self.layout, out)
        except CorruptBlockError as error:
            self._drop_corrupt(key, str(error))
            return None
        if block.tokens[: len(tokens)] != tuple(tokens):
            self._drop_corrupt(key, "tokens differ")
            return None
        return RemoteBlock(block, header.keep)

    @staticmethod
    def _continuations(reply: object) -> list[Continuation]:
        """Return the entries of a list of blocks written after a block, the newest last; a malformed one is skipped."""
        found: list[Continuation] = []
        for entry in reversed(reply) if isinstance(reply, list) else ():
            if isinstance(entry, bytes) and len(entry) > 16 and (len(entry) - 16) % 4 == 0:
                found.append((BlockKey(entry[:16]), tuple(array("I", entry[16:]))))
        return found

    # -- writing ------------------------------------------------------------------------------------------------

    def put(self, block: Block, keep: Keep = BY_POLICY) -> bool:
        """Queue `block` for Redis; return whether it was taken.

        Redis keeps the block for the tier's ttl or its own (`keep.ttl`, from `block.created`), whichever ends
        first, and at least until its retention ends; a block whose own lifetime is over is not taken. A block is
        dropped, and counted in `dropped_writes`, when the writer is too far behind or Redis is unavailable. The
        writer encodes the tensor later: hand one that nothing overwrites.
        """
        self.layout.check(block)
        if self._lifetime_ms(block.created, keep) is None:
            return False
        with self._lock:
            # Dropped rather than waited for: the caller may hold the store's lock, and the block stays in the tiers
            # above; only its Redis copy is skipped.
            if self._queued >= self._max_queued or not self._health.usable():
                self.counters.add("dropped_writes")
                return False
            self._queued += 1
        self._queue.put(_Put(block, keep))
        return True

    def retain(self, keys: Sequence[BlockKey], until: float) -> None:
        """Queue keeping the blocks in Redis at least until `until` (on the tier's clock); a longer TTL stays.

        Sent after every write queued before it, so a block put just before is kept too. Blocks Redis no longer
        holds are not brought back.
        """
        if keys and self._health.usable():
            self._queue.put(_Retain(tuple(keys), until))

    def remove(self, keys: Sequence[BlockKey]) -> None:
        """Queue the blocks' deletion from Redis, after every write queued before it."""
        if keys:
            self._queue.put(_Delete(tuple(keys)))

    def clear(self) -> int:
        """Delete every prefixgate block in the database, of every model and tenant; return how many.

        Other keys, the shared secret among them, are left alone. Redis keys carry no layout, and telling one
        model's blocks from another's would mean reading every value.
        """
        self.flush()  # blocks queued before the clear land before it, so it leaves none of them behind
        if not self._health.usable():
            return 0
        deleted = 0
        try:
            for prefix in (KEY_PREFIX, NEXT_PREFIX):
                counted = prefix == KEY_PREFIX  # the lists of what follows a block are not blocks
                batch: list[bytes] = []
                # UNLINK during SCAN is safe: SCAN still returns every key present for the whole scan.
                for name in self._writer_client.scan_iter(match=f"{prefix}*", count=_SCAN_COUNT):
                    batch.append(name)
                    if len(batch) >= _SCAN_COUNT:
                        deleted += self._writer_client.unlink(*batch) * counted
                        batch.clear()
                if batch:
                    deleted += self._writer_client.unlink(*batch) * counted
        except (RedisError, OSError) as error:
            self._fault(error)
            return deleted
        self._answered()
        return deleted

    def flush(self) -> None:
        """Wait until every write queued so far has been sent (or dropped)."""
        self._queue.join()

    def stats(self) -> RedisStats:
        """Return a snapshot of state and counters, without a round trip."""
        counters = self.counters
        with self._lock:
            queued_bytes = self._queued * self.layout.nbytes
        return RedisStats(
            name=self.name,
            url=self.url,
            available=self.available,
            hits=counters.hits,
            misses=counters.misses,
            promotions=counters.promotions,
            corrupt=counters.corrupt,
            dropped_writes=counters.dropped_writes,
            errors=counters.errors,
            round_trips=counters.round_trips,
            writes=counters.writes,
            written_bytes=counters.written_bytes,
            queued_bytes=queued_bytes,
        )

    def close(self) -> None:
        """Send what is queued (when Redis answers), stop the writer and close the connections."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            self._reader.close()
            self._writer_client.close()

    # -- the writer thread --------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        use_threads(1)  # it encodes tensors: no OpenMP pool of its own (see prefixgate.threads)
        max_puts = max(1, _BATCH_BYTES // self.layout.nbytes)
        while True:
            batch = [self._queue.get()]
            puts = int(isinstance(batch[0], _Put))  # blocks in the batch, each holding its tensor
            while batch[-1] is not None and len(batch) < _BATCH_OPS and puts < max_puts:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                puts += isinstance(batch[-1], _Put)
            ops = [op for op in batch if op is not None]
            try:
                self._write(ops)
            except Exception:  # the writer must outlive any one bad batch, or every later write is lost
                log.exception("writing %d operations to Redis at %s failed", len(ops), self.url)
            finally:
                with self._lock:
                    self._queued -= puts
                for _ in batch:
                    self._queue.task_done()
            if batch[-1] is None:
                return

    def _write(self, ops: list[_Put | _Delete | _Retain]) -> None:
        """Send the batch in one pipeline; count what Redis took and what it refused."""
        if not self._health.usable():
            # The deletes are lost too: a corrupt value fails verification again on its next read, and goes then.
            self.counters.add("dropped_writes", sum(isinstance(op, _Put) for op in ops))
            return
        pipe = self._writer_client.pipeline(transaction=False)
        # Per command sent: a put's encoded bytes; None for a delete or for the list of what follows a block.
        sizes: list[int | None] = []
        for op in ops:
            if isinstance(op, _Delete):
                for key in op.keys:  # one command a key: on a cluster, each may live on another node
                    pipe.unlink(_redis_key(key))
                    sizes.append(None)
                continue
            if isinstance(op, _Retain):
                milliseconds = int((op.until - self._clock()) * 1000)
                for key in op.keys if milliseconds > 0 else ():
                    pipe.pexpire(_redis_key(key), milliseconds, gt=True)  # GT (Redis 7): never shortens a TTL
                    sizes.append(None)
                continue
            block = op.block
            lifetime = self._lifetime_ms(block.created, op.keep)
            if lifetime is None:
                continue  # its own lifetime ran out while it waited
            value = encode(block, op.keep)
            pipe.set(_redis_key(block.key), value, px=lifetime)
            sizes.append(len(value))
            if block.parent is not None:
                # Listed after its parent, for a prompt that shares only its first tokens (see TieredStore). The list
                # lives as long as its newest block; entries for blocks gone meanwhile fail `get_block` and are skipped.
                following = _next_key(block.parent)
                pipe.lpush(following, block.key.digest + array("I", block.tokens).tobytes())
                pipe.ltrim(following, 0, NEXT_BLOCKS - 1)
                pipe.pexpire(following, lifetime)
                sizes += [None, None, None]
        if not sizes:
            return
        try:
            replies = pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as error:
            self._fault(error)
            self.counters.add("dropped_writes", sum(size is not None for size in sizes))
            return
        self._answered()
        refused: list[str] = []
        for size, reply in zip(sizes, replies, strict=True):
            if not isinstance(reply, Exception):
                if size is not None:
                    self.counters.add("writes")
                    self.counters.add("written_bytes", size)
                continue
            if size is not None:
                self.counters.add("dropped_writes")
            if not isinstance(reply, OutOfMemoryError):  # OOM is Redis full under `noeviction`: expected, not a fault
                self.counters.add("errors")
                refused.append(str(reply))
        if refused:
            log.warning("Redis at %s refused %d writes: %s", self.url, len(refused), refused[0])

    # -- faults -------------------------------------------------------------------------------------------------

    def _lifetime_ms(self, created: float, keep: Keep) -> int | None:
        """Return how long Redis keeps a block, in ms: the tier's ttl, or what is left of its own when sooner, and
        at least what is left of its retention."""
        now = self._clock()
        lifetime = self.ttl if keep.ttl is None else min(self.ttl, created + keep.ttl - now)
        if keep.retain_until is not None:
            lifetime = max(lifetime, keep.retain_until - now)
        milliseconds = int(lifetime * 1000)
        return milliseconds if milliseconds > 0 else None

    def _drop_corrupt(self, key: BlockKey, why: str) -> None:
        log.warning("dropping corrupt block %s from Redis at %s: %s", key.hex(), self.url, why)
        self.counters.add("corrupt")
        self.remove([key])

    def _fault(self, error: Exception) -> None:
        """Count a failed round trip and mark Redis unavailable until the backoff is over."""
        self.counters.add("errors")
        self._slots_stale = True  # a cluster's node may have failed over to another
        delay = self._health.failed()
        if delay is not None:  # None: a round trip begun before an earlier failure, already logged
            log.warning(
                "Redis at %s failed (%s: %s); answering misses, next try in %.3g s",
                self.url,
                type(error).__name__,
                error,
                delay,
            )
        # Idle connections are likely dead too (a restarted Redis closed them all): the next try opens new ones. A
        # cluster client finds its nodes again on its own.
        for client in (self._reader, self._writer_client):
            if isinstance(client, redis.Redis):
                client.connection_pool.disconnect(inuse_connections=False)

    def _answered(self) -> None:
        if self._health.succeeded():
            log.info("Redis at %s answers again", self.url)
            if self._secret is not None:
                try:
                    self._keep_secret()
                except (RedisError, OSError) as error:
                    log.warning("could not check the shared secret in Redis at %s: %s", self.url, error)

    def _keep_secret(self) -> None:
        """Put the shared secret back when Redis lost it (restarted without persistence), so servers started from
        now on key blocks as this one does; log when Redis holds another one."""
        assert self._secret is not None
        pipe = self._writer_client.pipeline(transaction=False)
        pipe.set(SECRET_KEY, self._secret, nx=True)
        pipe.get(SECRET_KEY)
        held = pipe.execute()[1]
        conflict = held != self._secret
        if conflict and not self._secret_conflict:
            log.error(
                "Redis at %s holds another shared secret than this server's: servers that read it key blocks apart "
                "from this one and share nothing with it; restart this server to share with them",
                self.url,
            )
        self._secret_conflict = conflict


def _redis_key(key: BlockKey) -> str:
    return f"{KEY_PREFIX}{key.hex()}"


def _next_key(parent: BlockKey) -> str:
    return f"{NEXT_PREFIX}{parent.hex()}"


def _lranges(keys: Sequence[BlockKey]) -> list[tuple[Any, ...]]:
    """Return the commands that read the lists of blocks written after each of `keys`."""
    return [("lrange", _next_key(key), 0, NEXT_BLOCKS - 1) for key in keys]


def _client(urls: tuple[str, ...], connect_timeout: float, timeout: float) -> redis.Redis | RedisCluster:
    """Return a client of one Redis, or of a Redis Cluster when `urls` names several of its nodes.

    A plain client connects when first used; a cluster client at once, to learn which node holds which slots.
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": connect_timeout,
        # One try per call: the tier's own backoff decides when to try again. redis-py's default (three more tries
        # with backoff, since 6.0) would turn one lookup against a dead Redis into seconds.
        "retry": Retry(NoBackoff(), 0),
        "client_name": "prefixgate",
    }
    shown = ", ".join(masked_url(url) for url in urls)
    try:
        if len(urls) == 1:
            return redis.Redis.from_url(urls[0], **options)
        # Credentials, TLS and options come from the first URL and apply to every node; the others add addresses.
        nodes = [
            ClusterNode(parts.hostname, parts.port or 6379)  # type: ignore[no-untyped-call]
            for parts in map(urlsplit, urls[1:])
        ]
        return RedisCluster.from_url(urls[0], startup_nodes=nodes, **options)
    except ValueError as error:  # a malformed port, database number or query option
        raise ConfigError(f"bad Redis URL in {shown!r}: {error}") from error
    except (RedisError, OSError) as error:
        raise StoreError(f"cannot reach the Redis Cluster at {shown} ({error}); check that it runs") from error
