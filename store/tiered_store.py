"""The tiered store: finds the longest cached prefix and moves blocks between tiers (the one place that does)."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from prefixgate.errors import StoreError
from prefixgate.policies import Policy, make_policy
from prefixgate.store.block import Block, BlockLayout, Keep, SlotOrder
from prefixgate.store.keys import BlockKey, Namespace, chain_keys, load_or_create_secret, shared_prefix
from prefixgate.store.lmdb_tier import LMDBTier
from prefixgate.store.memory_tier import MemoryTier, pins_pool
from prefixgate.store.redis_tier import (
    DEFAULT_QUEUE_BYTES,
    DEFAULT_SOCKET_TIMEOUT,
    DEFAULT_TTL,
    Continuation,
    RedisStats,
    RedisTier,
    RedisUsage,
    RemoteBlock,
)
from prefixgate.store.tier import EntryInfo, Tier, TierStats

DISK_FOLDER = "blocks.lmdb"
_LISTING_CHUNK = 256  # entries listed per hold of the lock: well under a millisecond
# Blocks after a prefix compared per tier for a partial reuse, the newest first: a bound on the lookup's work however
# many different continuations (one per question after a shared system prompt) a block has.
_CONTINUATIONS = 32


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One tier's byte budget and policy; a zero budget turns the tier off."""

    capacity_bytes: int
    policy: str = "lru"
    ttl: float | None = None  # seconds from insert
    idle_ttl: float | None = None  # seconds from last access


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """Where the remote tier is (one Redis URL, or several nodes of one Redis Cluster) and how it behaves."""

    urls: tuple[str, ...]
    ttl: float = DEFAULT_TTL  # seconds each block lives in Redis
    timeout: float = DEFAULT_SOCKET_TIMEOUT  # seconds a lookup waits for Redis before it answers a miss
    queue_bytes: int = DEFAULT_QUEUE_BYTES  # blocks waiting for the writer; a put beyond it is dropped


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The budgets and policies of the three local tiers, and the remote tier below them, if any."""

    device: TierConfig
    host: TierConfig
    disk: TierConfig
    remote: RemoteConfig | None = None

    @classmethod
    def defaults(cls, device: torch.device) -> StoreConfig:
        """Return budgets that suit `device`; on a CPU the host tier is the top and the device tier is off."""
        # Without a GPU both memory tiers would be CPU memory, and holding each block twice buys nothing.
        device_bytes = 4 << 30 if device.type == "cuda" else 0
        return cls(device=TierConfig(device_bytes), host=TierConfig(8 << 30), disk=TierConfig(64 << 30))


@dataclass(frozen=True, slots=True)
class PartialBlock:
    """A cached block that continues the prefix past its last whole block, reused up to where its tokens depart."""

    key: BlockKey
    tier: str
    # Its leading positions reused: up to the first token that differs (or the prompt's last token); 0 when the
    # nearest block continuing the prefix differs from the first token on.
    tokens: int
    block_tokens: tuple[int, ...]  # all its token ids, for explaining where it departs


@dataclass(frozen=True, slots=True)
class HeldRun:
    """The leading blocks of a prompt the local tiers hold, and the forks in them."""

    blocks: int
    # Block indices where prompts held here depart from this one: block i - 1 has more than one whole block after
    # it. The place to end a prefix that several prompts share.
    forks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Borrowed:
    """Blocks of a prompt lent in place from the top tier to running requests, until `give_back()`."""

    # Their K and V as they lie in the tier, one view per run of consecutive slots, in order:
    # each [layers, 2, kv_heads, tokens, head_dim].
    kv: tuple[torch.Tensor, ...]
    tiers: tuple[str, ...]  # where each block was found (below the top tier, it was promoted to be lent)
    give_back: Callable[[], None]  # ends the loan, once; calling it again does nothing

    @classmethod
    def nothing(cls) -> Borrowed:
        """Return a loan of no blocks."""
        return cls((), (), _nothing)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Where the cached prefix of a prompt lies: the tier of each leading block present, without loading any."""

    keys: tuple[BlockKey, ...]  # every block key the prompt may reuse (all but its last token)
    tiers: tuple[str, ...]  # the tier holding each leading block, as long as the run lasts
    block_size: int
    partial: PartialBlock | None = None  # the leading tokens of the block after the run, when some block has them

    @property
    def cached_tokens(self) -> int:
        """Return how many prompt tokens the prefix covers."""
        return len(self.tiers) * self.block_size + (self.partial.tokens if self.partial is not None else 0)

    @property
    def tokens_by_tier(self) -> dict[str, int]:
        """Return cached tokens per tier name."""
        counts: dict[str, int] = defaultdict(int)
        for name in self.tiers:
            counts[name] += self.block_size
        if self.partial is not None and self.partial.tokens:
            counts[self.partial.tier] += self.partial.tokens
        return dict(counts)


@dataclass(frozen=True, slots=True)
class PrefixHit(PrefixMatch):
    """A prefix match with its blocks loaded and verified, each from the tier named beside it."""

    blocks: tuple[Block, ...] = field(default=(), repr=False)
    # The partial block's reused positions, a view into the fetched prefix: [layers, 2, kv_heads, tokens, head_dim].
    partial_kv: torch.Tensor | None = field(default=None, repr=False)

    @property
    def kv(self) -> list[torch.Tensor]:
        """Return the prefix's K and V piece by piece: each whole block, then the partial block's positions."""
        return [block.kv for block in self.blocks] + ([self.partial_kv] if self.partial_kv is not None else [])


class TieredStore:
    """Blocks in tiers, top to bottom: device, host, disk, and the remote tier. Thread-safe; never call it on an event
    loop.

    Movement: inserts go to the top tier that can hold the whole set and are written through to the
    persistent tier and the remote one; eviction from a tier demotes to the next one down; a hit below the top is
    promoted to the top. Memory tiers hold a block at most once between them; the persistent tier holds what they
    hold and more. The remote tier (Redis, shared with other replicas) is asked after the local ones, for the rest
    of the chain in one round trip; it evicts and expires on its own.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        secret: bytes,
        remote: RedisTier | None = None,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not tiers:
            raise RuntimeError("a store needs at least one tier")
        layouts = {tier.layout for tier in tiers}
        if len(layouts) != 1:
            raise RuntimeError(f"all tiers must share one block layout, got {layouts}")
        self.layout = tiers[0].layout
        self.tiers = tuple(tiers)
        self.device = _indexed(torch.device(device))  # where fetched prefixes land: the model's device
        self._secret = secret
        self._clock = clock
        self._lock = threading.RLock()
        persistent = [tier for tier in tiers if tier.persistent]
        assert len(persistent) <= 1 and (not persistent or persistent[0] is tiers[-1]), "disk goes last"
        self._disk = persistent[0] if persistent else None
        self.remote = remote
        if remote is not None and remote.layout != self.layout:
            raise RuntimeError(f"the remote tier holds {remote.layout} blocks, the store {self.layout}")

    @classmethod
    def open(
        cls,
        folder: Path | None,
        layout: BlockLayout,
        config: StoreConfig,
        *,
        device: torch.device | str = "cpu",
        clock: Callable[[], float] = time.time,
        order: SlotOrder | None = None,
    ) -> TieredStore:
        """Open (or create) the store in `folder`; with no folder there is no disk tier and nothing persists. With
        `order`, the top tier lays its slots out in it (the model's attention kernel's, for the prefixes it lends: see
        `SlotOrder`); the others keep token order."""
        device = torch.device(device)
        tiers: list[Tier] = []
        for name, tier_config, tier_device in (
            ("device", config.device, device),
            ("host", config.host, torch.device("cpu")),
        ):
            if tier_config.capacity_bytes > 0:
                policy = _policy(tier_config, clock)
                tiers.append(
                    MemoryTier(
                        name,
                        layout,
                        tier_config.capacity_bytes,
                        policy,
                        clock=clock,
                        device=tier_device,
                        pin_memory=pins_pool(tier_device, device),
                        order=None if tiers else order,
                    )
                )
        disk = folder is not None and config.disk.capacity_bytes > 0
        if not tiers and not disk:
            raise StoreError("every tier has a zero budget; give at least one tier some bytes")
        remote = _open_remote(config.remote, layout, clock)
        try:
            if remote is not None:
                # Shared by every replica on this Redis, so all of them key a prompt's blocks alike.
                secret = remote.load_or_create_secret()
            elif disk:
                assert folder is not None
                secret = load_or_create_secret(folder)
            else:
                secret = os.urandom(32)  # nothing outlives the process, so neither does the secret
            if disk:
                assert folder is not None
                disk_policy = _policy(config.disk, clock)
                tiers.append(
                    LMDBTier.open(folder / DISK_FOLDER, layout, config.disk.capacity_bytes, disk_policy, clock=clock)
                )
        except BaseException:
            if remote is not None:
                remote.close()
            raise
        return cls(tiers, secret=secret, remote=remote, device=device, clock=clock)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """Return the names of every tier, top first, the remote tier last."""
        return tuple(tier.name for tier in self.tiers) + ((self.remote.name,) if self.remote is not None else ())

    # -- keys and lookups ---------------------------------------------------------------------------------------

    def seed(self, namespace: Namespace) -> bytes:
        """Return the chain seed of `namespace` in this deployment."""
        self._check_namespace(namespace)
        # Computed each time (a few microseconds), not cached: clients choose `cache_salt`, so a cache of seeds by
        # namespace would grow with every salt anyone sends.
        return namespace.seed(self._secret)

    def reusable_keys(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[BlockKey, ...]:
        """Return the keys of the full blocks a prompt may reuse: never its last token, which starts generation."""
        limit = (len(tokens) - 1) // self.layout.block_size if tokens else 0
        return tuple(chain_keys(self.seed(namespace), tokens, self.layout.block_size, limit=limit))

    def lookup(self, namespace: Namespace, tokens: Sequence[int]) -> PrefixMatch:
        """Return where the prompt's cached prefix lies, loading and moving nothing."""
        keys = self.reusable_keys(namespace, tokens)
        tiers: list[str] = []
        for key in keys:
            tier = self._locate(key)
            if tier is None:
                break
            tiers.append(tier.name)
        following = None
        if self.remote is not None and len(tiers) < len(keys):
            start = len(tiers)
            found = self.remote.present(keys[start:], parent=keys[start - 1] if start else None)
            tiers += [self.remote.name] * found.run
            following = found.following
        partial = self._continuation(keys, len(tiers), tokens, following)
        return PrefixMatch(keys, tuple(tiers), self.layout.block_size, partial)

    def fetch(
        self,
        namespace: Namespace,
        tokens: Sequence[int],
        out: torch.Tensor | None = None,
        *,
        start: int = 0,
        stop: int | None = None,
    ) -> PrefixHit:
        """Load and verify the prompt's cached prefix, promoting blocks found below the top tier.

        The prefix is assembled in one tensor, one copy per block, and each block's tensor is a view into it: into
        the leading positions of `out` (`[layers, 2, kv_heads, capacity, head_dim]` on the store's device, such as
        a buffer the backend lends, with room for all the prompt's tokens but its last) when given, else into a new
        tensor. After the whole blocks, the leading positions of a partial block may follow (`PrefixHit.partial`).

        `start` whole blocks are the caller's already (read from elsewhere, never fetched): `out` then begins at
        block `start`, and the hit's tiers and blocks name the fetched ones only. With `stop`, whole blocks up to
        block `stop` (not included) are fetched, and nothing after them.
        """
        self.expire()
        size = self.layout.block_size
        keys = self.reusable_keys(namespace, tokens)
        wanted = keys[: len(keys) if stop is None else stop]
        blocks: list[Block] = []
        tiers: list[str] = []
        layers, two, heads, _, head_dim = self.layout.shape
        # The most a prefix may cover: the last token is always computed.
        reach = max(len(tokens) - 1, 0) if stop is None else len(wanted) * size
        reach -= start * size
        if out is None:
            out = torch.empty(
                (layers, two, heads, reach, head_dim), dtype=self.layout.dtype, device=self.device
            )  # out: [layers, 2, kv_heads, tokens, head_dim]
        else:
            self._check_out(out, reach)
        for index in range(start, len(wanted)):
            slot = out[:, :, :, (index - start) * size : (index - start + 1) * size]
            found = self._get(wanted[index], tokens[index * size : (index + 1) * size], slot)
            if found is None:
                break
            blocks.append(found[0])
            tiers.append(found[1].name)
        following = None
        run = start + len(blocks)
        if self.remote is not None and run < len(wanted):
            parent = keys[run - 1] if run else None
            remote = self.remote.get_chain(
                wanted[run:], tokens[run * size :], out[:, :, :, (run - start) * size :], parent=parent
            )
            self._promote_remote(remote.blocks)
            blocks += [found.block for found in remote.blocks]
            tiers += [self.remote.name] * remote.run
            following = remote.following
        if stop is not None:
            return PrefixHit(keys, tuple(tiers), size, None, tuple(blocks))
        run = start + len(blocks)
        after = out[:, :, :, (run - start) * size :]  # after: [layers, 2, kv_heads, positions past the run, head_dim]
        partial, partial_kv = self._load_continuation(keys, run, tokens, after, following)
        return PrefixHit(keys, tuple(tiers), size, partial, tuple(blocks), partial_kv)

    def held(self, namespace: Namespace, tokens: Sequence[int]) -> HeldRun:
        """Return how many of the prompt's leading reusable blocks the local tiers hold, and where other prompts
        held here depart from it, asking no remote tier.

        Each block found in memory counts as a use there: a request that reads it from a copy already in memory
        (a shared prefix) uses it as much as one that fetches it, and the policy should know.
        """
        self.expire()
        keys = self.reusable_keys(namespace, tokens)
        blocks = 0
        forks: list[int] = []
        for key in keys:
            tier = self._locate(key)
            if tier is None:
                break
            if not tier.persistent:
                with self._lock:
                    tier.touch(key)
            blocks += 1
        for index in range(1, blocks + 1):
            # A fork: the block before has another whole block after it (a tail, a partial last block, is not one).
            children: set[BlockKey] = set()
            for tier in self.tiers:
                with self._lock if not tier.persistent else contextlib.nullcontext():
                    # Two whole blocks after it are a fork: no tier need list more than two.
                    children.update(key for key, _ in tier.children(keys[index - 1], newest=2, whole=True))
            if len(children) > 1:
                forks.append(index)
        return HeldRun(blocks, tuple(forks))

    def _continuation(
        self,
        keys: Sequence[BlockKey],
        run: int,
        tokens: Sequence[int],
        following: Sequence[Continuation] | None = None,
    ) -> PartialBlock | None:
        """Return the held block after the run's last whole block that shares the most leading tokens with the
        prompt's next ones (never its last token), or None when no block follows it.

        Only blocks under the same parent key qualify, and a parent key belongs to one namespace, so a tenant's
        partial block comes from its own blocks. The first block of a prompt has no parent to look under. Redis's list
        of what follows comes as `following` when the run was read from there; else Redis is asked (one round trip)
        only when no local block has all the tokens wanted.
        """
        size = self.layout.block_size
        wanted = tuple(tokens[run * size : min((run + 1) * size, len(tokens) - 1)])
        if run == 0 or not wanted:
            return None
        best: PartialBlock | None = None
        for tier in self.tiers:
            with self._lock:
                children = tier.children(keys[run - 1], newest=_CONTINUATIONS)
            best = _nearer(best, tier.name, children, wanted)
        if self.remote is not None and following is None and (best is None or best.tokens < len(wanted)):
            following = self.remote.continuations(keys[run - 1])
        if self.remote is not None and following:
            best = _nearer(best, self.remote.name, following, wanted)
        return best

    def _load_continuation(
        self,
        keys: Sequence[BlockKey],
        run: int,
        tokens: Sequence[int],
        out: torch.Tensor,
        following: Sequence[Continuation] | None,
    ) -> tuple[PartialBlock | None, torch.Tensor | None]:
        """Copy the best partial block's shared positions into `out` (which starts where the run ends); return it and
        their view."""
        partial = self._continuation(keys, run, tokens, following)
        if partial is None or not partial.tokens:
            return partial, None
        start = run * self.layout.block_size
        shared = tuple(tokens[start : start + partial.tokens])
        view = out[:, :, :, : partial.tokens]  # view: [layers, 2, kv_heads, partial, head_dim]
        if self.remote is not None and partial.tier == self.remote.name:
            block = self.remote.get_block(partial.key, shared)  # verified there: checksum and tokens
            if block is None:
                return None, None
            view.copy_(block.kv[:, :, :, : partial.tokens])
            return partial, view
        tier = next(tier for tier in self.tiers if tier.name == partial.tier)
        # A memory tier's look is a view into its pool, valid while it does not change: read it under the lock. A disk
        # read is not held under it.
        with self._lock if not tier.persistent else contextlib.nullcontext():
            # Verified here: the positions used hold the prompt's tokens (and on disk the checksum matches).
            block = tier.peek(partial.key)
            if block is None or block.tokens[: partial.tokens] != shared:
                return None, None
            view.copy_(block.kv[:, :, :, : partial.tokens])
        tier.touch(partial.key)
        return partial, view

    def _check_out(self, out: torch.Tensor, tokens: int) -> None:
        layers, two, heads, _, head_dim = self.layout.shape
        if (
            out.dim() != 5
            or (out.shape[0], out.shape[1], out.shape[2], out.shape[4]) != (layers, two, heads, head_dim)
            or out.shape[3] < tokens
            or out.dtype != self.layout.dtype
            or out.device.type != self.device.type
            or out.device.index not in (None, self.device.index)
        ):
            raise ValueError(
                f"fetch(out=) needs a {self.layout.dtype_name} tensor on {self.device} of shape [{layers}, {two}, "
                f"{heads}, at least {tokens}, {head_dim}] for this prompt; got {tuple(out.shape)} "
                f"{str(out.dtype).removeprefix('torch.')} on {out.device}"
            )

    @property
    def slot_order(self) -> SlotOrder | None:
        """Return the order the prefixes `borrow` lends lie in: the top tier's (None: token by token)."""
        top = self.tiers[0]
        return top.order if isinstance(top, MemoryTier) else None

    @property
    def lends(self) -> bool:
        """Return whether the top tier is memory on the model's device, which `borrow` lends in place."""
        top = self.tiers[0]
        return isinstance(top, MemoryTier) and _indexed(top.device) == self.device and top.capacity_blocks > 0

    def borrow(self, namespace: Namespace, tokens: Sequence[int], *, start: int, stop: int) -> Borrowed:
        """Lend the prompt's blocks `start` to `stop` (not included) in place, from the top tier, for running requests
        to read without a copy; a block found below it is promoted first. Stops at the first block it cannot lend (not
        held, or the top tier full of blocks it cannot evict): fewer tiers than blocks asked say so.

        Lent blocks are never evicted; one removed meanwhile (a flush, a delete) keeps its memory until given back.
        """
        if not self.lends:
            return Borrowed.nothing()
        self.expire()
        top = self.tiers[0]
        assert isinstance(top, MemoryTier)
        keys = self.reusable_keys(namespace, tokens)[:stop]
        slots: list[int] = []
        tiers: list[str] = []
        loan = _Loan(self._lock, top, slots)
        try:
            self._lend(top, keys, tokens, start, slots, tiers)
        except BaseException:
            loan.give_back()
            raise
        runs: list[torch.Tensor] = []
        first = 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                runs.append(top.span(slots[first], i - first))
                first = i
        return Borrowed(tuple(runs), tuple(tiers), loan.give_back)

    def _lend(
        self,
        top: MemoryTier,
        keys: Sequence[BlockKey],
        tokens: Sequence[int],
        start: int,
        slots: list[int],
        tiers: list[str],
    ) -> None:
        """Borrow blocks `start` on of `keys` from the top tier, promoting those below, into `slots` and `tiers`, up to
        the first it cannot lend; then gather them into one run of slots where the tier can."""
        size = self.layout.block_size
        scratch: torch.Tensor | None = None
        for index in range(start, len(keys)):
            ids = tokens[index * size : (index + 1) * size]
            with self._lock:
                slot = top.borrow(keys[index], ids)
            if slot is not None:
                top.counters.add("hits")
                tiers.append(top.name)
            else:
                if scratch is None:
                    scratch = torch.empty(self.layout.shape, dtype=self.layout.dtype, device=self.device)
                found = self._get(keys[index], ids, scratch)  # promoted to the top tier when it has room
                if found is None:
                    break
                with self._lock:
                    slot = top.borrow(keys[index], ids)
                if slot is None:
                    break
                tiers.append(found[1].name)
            slots.append(slot)
        lent = keys[start : start + len(slots)]
        with self._lock:
            if all(after == before + 1 for before, after in itertools.pairwise(slots)):
                return
            if not all(top.contains(key) for key in lent):
                return  # one was removed meanwhile: its slot waits for this loan, and does not move
            # Given back only to be gathered, and lent again: nothing else reaches the tier while the lock is held.
            for slot in slots:
                top.give_back(slot)
            top.gather(lent)
            for place, key in enumerate(lent):
                index = start + place
                again = top.borrow(key, tokens[index * size : (index + 1) * size])
                assert again is not None, "a block held a moment ago under the lock is held still"
                slots[place] = again

    # -- inserts ------------------------------------------------------------------------------------------------

    def put(
        self,
        blocks: Sequence[Block],
        *,
        pinned: bool = False,
        ttl: float | None = None,
        retain: float | None = None,
    ) -> int:
        """Insert blocks (standalone tensors the store may keep); return how many were new to the store.

        `pinned` blocks are never evicted until unpinned or expired; `ttl` (seconds from the block's creation)
        overrides the tiers' own; `retain` keeps them at least that many seconds from now (see `retain`). A block
        with no creation time is stamped with the store's clock.
        """
        for block in blocks:
            self.layout.check(block)
        self.expire()
        now = self._clock()
        keep = Keep(pinned, ttl, None if retain is None else now + retain)
        changes_attrs = pinned or ttl is not None
        added = 0
        with self._lock:
            memory = [level for level, tier in enumerate(self.tiers) if not tier.persistent]
            # A set too big for a tier skips it, rather than flushing everything there to make room for itself.
            top = next((level for level in memory if self.tiers[level].can_hold(len(blocks))), None)
            for block in blocks:
                if not block.created:
                    block = replace(block, created=now)
                where = self._locate(block.key)
                if where is not None and not where.persistent and not changes_attrs:
                    where.touch(block.key)  # already in memory: just a use
                    continue
                added += where is None
                # A block held already keeps a longer retention it has.
                held = where.attrs(block.key) if where is not None else None
                block_keep = keep if held is None else keep.merged(held)
                if top is not None:
                    self._remove_from_memory(block.key)
                    self._insert(top, block, block_keep)
                if self._disk is not None and (where is None or changes_attrs):
                    self._insert(len(self.tiers) - 1, block, block_keep)
                if self.remote is not None and (where is None or changes_attrs):
                    self.remote.put(block, block_keep)
            if keep.retain_until is not None:
                self._retain_held([block.key for block in blocks], keep.retain_until)
        return added

    def retain(self, keys: Sequence[BlockKey], seconds: float) -> int:
        """Keep the blocks at least `seconds` from now; return how many are held locally.

        A retained block never expires before its retention ends, and a tier evicts it only when nothing unretained
        is left to evict there (its budget still holds); evicted from a memory tier, it is demoted like any other. A
        retention only grows: a shorter one leaves a longer one as it is. In Redis, where eviction is Redis's own,
        the blocks' TTLs are lengthened to match, in the background.
        """
        if not seconds > 0:
            raise ValueError(f"retain needs a positive number of seconds, got {seconds}")
        self.expire()  # a block whose time is up is not brought back
        until = self._clock() + seconds
        if self.remote is not None:
            self.remote.retain(keys, until)
        with self._lock:
            return self._retain_held(keys, until)

    def pin(self, key: BlockKey, pinned: bool = True) -> bool:
        """Pin (or unpin) a block in every tier holding it; return whether any does."""
        with self._lock:
            return any([tier.pin(key, pinned) for tier in self.tiers])

    # -- inspection and removal ---------------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        """Return each tier's occupancy and counters, top tier first."""
        with self._lock:
            return [tier.stats() for tier in self.tiers]

    def remote_stats(self) -> RedisStats | None:
        """Return the remote tier's state and counters, without a round trip; None when there is no remote tier."""
        return None if self.remote is None else self.remote.stats()

    def remote_usage(self) -> RedisUsage | None:
        """Return what the remote Redis holds (a SCAN of it: for an operator's look); None without a remote tier."""
        return None if self.remote is None else self.remote.usage()

    def entries(self, *, tier: str | None = None, tenant: str | None = None) -> list[EntryInfo]:
        """Return every cached block, optionally only those in one tier or of one tenant.

        Every tier's keys are read at one moment, so a block stored meanwhile is in no tier's list rather than in
        one only. Their entries are then read a few hundred at a time, so a listing of a large disk tier never stalls
        requests for long; a block that leaves a tier meanwhile is not listed there.
        """
        with self._lock:
            held = [(listed, listed.keys()) for listed in self._tiers_named(tier)]
        found: list[EntryInfo] = []
        for listed, keys in held:
            for start in range(0, len(keys), _LISTING_CHUNK):
                with self._lock:
                    infos = [listed.entry(key) for key in keys[start : start + _LISTING_CHUNK]]
                found += [info for info in infos if info is not None]  # None: removed since the keys were read
                time.sleep(0)  # yield, so a thread waiting for the lock takes it before this one takes it again
        return [entry for entry in found if tenant is None or entry.tenant == tenant]

    def entry(self, key: BlockKey) -> list[EntryInfo]:
        """Return the entries of one key, one per tier holding it."""
        with self._lock:
            return [info for tier in self.tiers if (info := tier.entry(key)) is not None]

    def read(self, key: BlockKey) -> Block | None:
        """Return a copy of one block from the highest tier holding it, without moving or counting it."""
        with self._lock:
            for tier in self.tiers:
                block = tier.peek(key)
                if block is not None:
                    return replace(block, kv=block.kv.clone())
        return None

    def delete(self, key: BlockKey, *, extensions: bool = False) -> int:
        """Remove a block from every tier (and, with `extensions`, every block that extends it); return the count."""
        with self._lock:
            doomed = {key}
            if extensions:
                children: dict[BlockKey, set[BlockKey]] = defaultdict(set)
                for entry in self.entries():
                    if entry.parent is not None:
                        children[entry.parent].add(entry.key)
                frontier = [key]
                while frontier:
                    for child in children.pop(frontier.pop(), ()):
                        doomed.add(child)
                        frontier.append(child)
            if self.remote is not None:
                self.remote.remove(list(doomed))
            return sum(tier.remove(k) for k in doomed for tier in self.tiers)

    def flush(self, tier: str | None = None) -> int:
        """Drop every block of one tier, or of all tiers; return how many entries were dropped.

        The remote tier is shared: flushing it drops every replica's blocks there, of every model and tenant.
        """
        remote = self.remote if self.remote is not None and tier in (None, self.remote.name) else None
        local = () if remote is not None and tier is not None else self._tiers_named(tier)
        with self._lock:
            dropped = sum(t.clear() for t in local)
        if remote is not None:
            dropped += remote.clear()  # outside the lock: a SCAN of the whole Redis
        return dropped

    def expire(self) -> int:
        """Drop every block whose time is up, tier by tier; return how many were dropped."""
        dropped = 0
        with self._lock:
            for tier in self.tiers:
                for key in tier.expired():
                    tier.remove(key)
                    tier.counters.add("expirations")
                    dropped += 1
        return dropped

    def wait_for_writes(self) -> None:
        """Block until every block written through so far is on disk and sent to the remote tier."""
        if isinstance(self._disk, LMDBTier):
            self._disk.flush()
        if self.remote is not None:
            self.remote.flush()

    def close(self) -> None:
        """Finish pending writes and release every tier."""
        with self._lock:
            for tier in self.tiers:
                tier.close()
        if self.remote is not None:
            self.remote.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- movement -----------------------------------------------------------------------------------------------

    def _locate(self, key: BlockKey) -> Tier | None:
        with self._lock:
            for tier in self.tiers:
                if not tier.persistent and tier.contains(key):
                    return tier
        if self._disk is not None and self._disk.contains(key):
            return self._disk
        return None

    def _get(self, key: BlockKey, tokens: Sequence[int], out: torch.Tensor) -> tuple[Block, Tier] | None:
        """Copy the verified block into `out`; return it and the tier it came from, counting hits and misses."""
        missed: list[Tier] = []
        for level, tier in enumerate(self.tiers):
            if tier.persistent:
                block = tier.get(key, tokens, out)  # a disk read: outside the lock
            else:
                with self._lock:
                    block = tier.get(key, tokens, out)
            if block is None:
                missed.append(tier)
                continue
            tier.counters.add("hits")
            for above in missed:
                above.counters.add("misses")
            if level > 0:
                self._promote(level, block)
            return block, tier
        for tier in missed:
            tier.counters.add("misses")
        return None

    def _retain_held(self, keys: Sequence[BlockKey], until: float) -> int:
        held = 0
        for key in keys:
            held += any([tier.retain(key, until) for tier in self.tiers])
        return held

    def _promote(self, level: int, block: Block) -> None:
        with self._lock:
            source = self.tiers[level]
            keep = source.attrs(block.key)
            # Inserted above before it leaves here: when the top tier cannot take it (full of pinned blocks), it
            # stays where it is rather than being lost.
            if keep is None or not self._insert(0, block, keep):
                return
            if not source.persistent:
                source.remove(block.key)
            source.counters.add("promotions")

    def _insert(self, level: int, block: Block, keep: Keep) -> bool:
        """Put a block in one tier, demoting its victims; return False when the tier cannot take it."""
        tier = self.tiers[level]
        if not tier.can_hold(1):
            return False
        if not tier.contains(block.key):
            while not tier.has_room():
                victim = tier.victim()
                if victim is None:
                    return False  # everything here is pinned
                self._demote(level, victim)
        return tier.put(block, keep)

    def _promote_remote(self, found: Sequence[RemoteBlock]) -> None:
        """Keep blocks read from the remote tier in the top local tier, as a disk hit is kept."""
        top = self.tiers[0]
        promoted = 0
        with self._lock:
            for tier in self.tiers:  # each local tier missed these blocks too; the first miss is counted already
                tier.counters.add("misses", max(0, len(found) - 1))
            for remote in found:
                block = remote.block
                if top.persistent:  # the tensor is a view into the caller's buffer, and the disk writer encodes later
                    block = replace(block, kv=block.kv.clone())
                promoted += self._insert(0, block, remote.keep)
        assert self.remote is not None
        self.remote.counters.add("promotions", promoted)

    def _demote(self, level: int, key: BlockKey) -> None:
        tier = self.tiers[level]
        keep = tier.attrs(key)
        below = self.tiers[level + 1] if level + 1 < len(self.tiers) else None
        moved = False
        if keep is not None and below is not None:
            if below.persistent and below.contains(key):
                moved = True  # written through already: not even looked at (a look in a tier's own order copies)
            elif (block := tier.peek(key)) is not None:
                # A view into this tier's pool, which the disk writer would encode later: copied first, unless the look
                # copied it already (a tier in an order of its own gives blocks in token order).
                copied = isinstance(tier, MemoryTier) and tier.order is not None
                kv = block.kv.clone() if below.persistent and not copied else block.kv
                moved = self._insert(level + 1, replace(block, kv=kv), keep)
        tier.remove(key)
        tier.counters.add("demotions" if moved else "evictions")

    def _remove_from_memory(self, key: BlockKey) -> None:
        for tier in self.tiers:
            if not tier.persistent:
                tier.remove(key)

    def _tiers_named(self, name: str | None) -> tuple[Tier, ...]:
        if name is None:
            return self.tiers
        chosen = tuple(tier for tier in self.tiers if tier.name == name)
        if not chosen:
            names = ", ".join(self.tier_names)
            raise StoreError(f"no tier named {name!r}; this store has: {names}")
        return chosen

    def _check_namespace(self, namespace: Namespace) -> None:
        if namespace.block_shape != self.layout.shape or namespace.dtype != self.layout.dtype_name:
            raise RuntimeError(
                f"namespace is for {namespace.block_shape} {namespace.dtype} blocks, "
                f"but this store holds {self.layout.shape} {self.layout.dtype_name}"
            )


class _Loan:
    """Slots lent to running requests, given back once."""

    def __init__(self, lock: threading.RLock, tier: MemoryTier, slots: list[int]) -> None:
        self._lock = lock
        self._tier = tier
        self._slots: list[int] | None = slots

    def give_back(self) -> None:
        with self._lock:
            slots, self._slots = self._slots, None
            for slot in slots or ():
                self._tier.give_back(slot)


def _nothing() -> None:
    pass


def _nearer(
    best: PartialBlock | None, tier: str, candidates: Sequence[Continuation], wanted: Sequence[int]
) -> PartialBlock | None:
    """Return whichever shares more leading tokens with `wanted`: `best`, or the newest best of `candidates`."""
    for key, block_tokens in reversed(candidates):
        shared = shared_prefix(block_tokens, wanted)
        if best is None or shared > best.tokens:
            best = PartialBlock(key, tier, shared, block_tokens)
    return best


def _open_remote(config: RemoteConfig | None, layout: BlockLayout, clock: Callable[[], float]) -> RedisTier | None:
    if config is None:
        return None
    return RedisTier(
        config.urls,
        layout,
        ttl=config.ttl,
        socket_timeout=config.timeout,
        queue_bytes=config.queue_bytes,
        clock=clock,
    )


def _policy(config: TierConfig, clock: Callable[[], float]) -> Policy:
    return make_policy(config.policy, clock=clock, ttl=config.ttl, idle_ttl=config.idle_ttl)


def _indexed(device: torch.device) -> torch.device:
    """Return `device` with its index: tensors on "cuda" report "cuda:0", and `fetch(out=)` compares the two."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
