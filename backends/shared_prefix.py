"""Shared prefixes: a cached prefix that running requests start from, read by all of them in place.

A prompt's cached blocks are lent to a shared prefix by the store's top tier, as they lie in its memory (on the
model's device), and every running request whose prompt starts with the same blocks reads it there: its own KV buffer
holds only what follows, and attention over the prefix runs once per step for all its readers (`attention.py`). The
tier and the running requests hold one copy between them, under the tier's budget: admission counts each request for
its own tokens only. A shared prefix may extend another (a system prompt shared by all, a document after it shared by
some): each holds its own positions only and is read by the readers of every prefix that extends it.

Life of one: the first request that needs it creates it, empty, and has the store lend it the blocks before it is
admitted itself; requests arriving meanwhile wait for that fill instead of fetching their own copy. Where its cached
blocks run on past a fork (other cached prompts departing), it creates and fills one per level, so that it reads all
of them in place from its first step as later requests do. Each reader holds a reference, a prefix extending it holds
one, and so does the fill while it runs. When the last goes, the loan ends: the blocks stay in the tier under its
policy (while lent, it never evicts them, and a flush keeps their memory until then). A fill that cannot lend every
block (the tier full of blocks it cannot evict) fails the prefix and any level after it, and its readers copy those
blocks into their own buffers, as before sharing; the request that filled it still reads the levels before it in
place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Hashable, Sequence

import torch

# Runs of fewer cached tokens than this (4 blocks of the default 64) are copied into the request's own buffer: a
# shared prefix costs an attention call and a merge per layer and step, which a short one does not repay.
MIN_SHARED_TOKENS = 256


class SharedPrefix:
    """One run of cached blocks in memory, after its parent's, read in place by the requests that start with it."""

    def __init__(self, key: Hashable, parent: SharedPrefix | None, blocks: int, block_size: int) -> None:
        self.key = key  # the id of its last block: chained ids name every block before it too
        self.parent = parent
        self.blocks: int = blocks  # blocks from position 0 through its own
        self.first_block: int = parent.blocks if parent is not None else 0
        self.start = self.first_block * block_size  # positions before it, held by its parents
        self.tokens = (blocks - self.first_block) * block_size
        # Its K and V where the store lends them, once filled: one view per run of memory, in order, each
        # [layers, 2, kv_heads, tokens, head_dim], the same tensor objects for every reader.
        self.kv: tuple[torch.Tensor, ...] = ()
        self.tiers: tuple[str, ...] = ()  # where each of its blocks was read from, once filled
        self.filled: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self.references = 0
        self.give_back: Callable[[], None] | None = None  # ends the store's loan of its blocks
        self.nbytes = 0  # the bytes of its K and V, once filled

    @property
    def end(self) -> int:
        """Return the position after its last: a reader's own buffer starts there."""
        return self.start + self.tokens

    def chain(self) -> tuple[SharedPrefix, ...]:
        """Return it and its parents, the root first."""
        chain: list[SharedPrefix] = []
        prefix: SharedPrefix | None = self
        while prefix is not None:
            chain.append(prefix)
            prefix = prefix.parent
        return tuple(reversed(chain))


class PrefixStart:
    """A request's start from shared prefixes: the longest one it reads (referenced), and the new ones it must fill,
    parents first."""

    def __init__(self, prefixes: SharedPrefixes, prefix: SharedPrefix, fills: Sequence[SharedPrefix] = ()) -> None:
        self.prefix = prefix
        self._fills = list(fills)  # fill each from the store (its blocks `first_block` to `blocks`), calling `filled`
        self._prefixes = prefixes
        self._held = True

    @property
    def end(self) -> int:
        """Return the positions the shared prefixes hold once filled: the request's own buffer starts there."""
        return self.prefix.end

    @property
    def fill(self) -> SharedPrefix | None:
        """Return the next new prefix to fill, or None when none is left."""
        return self._fills[0] if self._fills else None

    @property
    def fills(self) -> tuple[SharedPrefix, ...]:
        """Return the new prefixes left to fill, parents first."""
        return tuple(self._fills)

    def filled(self, kv: Sequence[torch.Tensor], tiers: Sequence[str], give_back: Callable[[], None]) -> bool:
        """Report the fill of `fill`: its blocks' K and V lent in place (runs of positions, in order), where each block
        came from (fewer names than blocks fail the prefix), and what ends the loan. Return whether it is complete;
        once one is not, the prefixes after it are failed too (reported as lending nothing), and the request starts
        from the one before it, if any, copying the rest of its cached prefix into its own buffer."""
        assert self._fills, "only the request that created a prefix fills it"
        level = self._fills.pop(0)
        complete = self._prefixes.filled(level, kv, tiers, give_back)
        if not complete:
            while self._fills:
                self._prefixes.filled(self._fills.pop(0), (), (), lambda: None)
            if level.parent is not None and self._held:
                self._prefixes.hold(level.parent)  # before letting go of the failed ones, which hold it too
                self._prefixes.release(self.prefix)
                self.prefix = level.parent
        return complete

    async def settle(self) -> bool:
        """Wait until every prefix read is filled; return whether all of them were (else the start is released)."""
        ok = [await asyncio.wrap_future(link.filled) for link in self.prefix.chain()]
        if not all(ok):
            self.release()
        return all(ok)

    def release(self) -> None:
        """Let go of the prefixes, once. A fill is reported by its filler alone, whatever happens to the request:
        it holds a reference of its own while it writes."""
        if self._held:
            self._held = False
            self._prefixes.release(self.prefix)


class SharedPrefixes:
    """The shared prefixes in memory, found by the ids of the blocks they hold. Thread-safe."""

    def __init__(self, block_size: int, *, min_tokens: int = MIN_SHARED_TOKENS) -> None:
        self._block_size = block_size
        self._min_tokens = min_tokens
        self._by_key: dict[Hashable, SharedPrefix] = {}
        self._live = 0  # prefixes in memory, found or not (one whose fill failed lives on while its readers do)
        self._bytes = 0  # the K and V they read
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._live

    def nbytes(self) -> int:
        """Return the bytes of K and V shared prefixes read now."""
        return self._bytes

    def attach(self, ids: Sequence[Hashable], forks: Sequence[int] = ()) -> PrefixStart | None:
        """Start a request from the longest shared prefix of blocks `ids` (block 0 first, each cached in the store).

        When the cached blocks run on past every shared prefix, new ones are created for the request to fill, each at
        least `min_tokens` long: each ends at the first of `forks` (block indices where other cached prompts depart
        from this one) that allows, so that those prompts can read it too, the last at the last cached block. What
        follows them is the request's own (or, read on past it by later requests, a prefix of its own in turn).
        Return None when there is nothing to share.
        """
        size = self._block_size
        with self._lock:
            found = None
            for count in range(len(ids), 0, -1):
                prefix = self._by_key.get(ids[count - 1])
                if prefix is not None and prefix.blocks == count:
                    found = prefix
                    break
            fills: list[SharedPrefix] = []
            covered = found.blocks if found is not None else 0
            while covered < len(ids):
                least = covered + -(-self._min_tokens // size)  # the fewest blocks a new prefix may end after
                end = min((fork for fork in forks if least <= fork <= len(ids)), default=len(ids))
                if end < least:
                    break
                fill = SharedPrefix(ids[end - 1], found, end, size)
                self._live += 1
                if found is not None:
                    found.references += 1  # held by the new prefix for as long as it lives
                fill.references = 1  # the fill's, dropped by filled()
                self._by_key[fill.key] = fill
                fills.append(fill)
                found, covered = fill, end
            if found is None:
                return None
            found.references += 1
        return PrefixStart(self, found, fills)

    def filled(
        self, prefix: SharedPrefix, kv: Sequence[torch.Tensor], tiers: Sequence[str], give_back: Callable[[], None]
    ) -> bool:
        """Report a fill done (see `PrefixStart.filled`); return whether it is complete."""
        complete = len(tiers) == prefix.blocks - prefix.first_block
        if complete:
            assert sum(run.shape[3] for run in kv) == prefix.tokens, "a fill lends every position of its prefix"
        else:
            give_back()  # a prefix short of blocks is read by nobody
        with self._lock:
            if complete:
                prefix.kv, prefix.tiers, prefix.give_back = tuple(kv), tuple(tiers), give_back
                prefix.nbytes = sum(run.numel() * run.element_size() for run in kv)
                self._bytes += prefix.nbytes
            elif self._by_key.get(prefix.key) is prefix:
                del self._by_key[prefix.key]  # nobody new attaches to it; its readers go on without it
        prefix.filled.set_result(complete)
        self.release(prefix)
        return complete

    def hold(self, prefix: SharedPrefix) -> None:
        """Take one more reference on a prefix someone holds."""
        with self._lock:
            assert prefix.references > 0, "a prefix nobody holds is gone"
            prefix.references += 1

    def release(self, prefix: SharedPrefix) -> None:
        """Drop one reference; a prefix nobody references any more ends its loan."""
        freed: list[SharedPrefix] = []
        with self._lock:
            current: SharedPrefix | None = prefix
            while current is not None:
                current.references -= 1
                assert current.references >= 0, "a shared prefix was released more often than attached"
                if current.references:
                    break
                if self._by_key.get(current.key) is current:
                    del self._by_key[current.key]
                freed.append(current)
                self._live -= 1
                self._bytes -= current.nbytes
                current = current.parent  # its reference on the parent goes with it
        for gone in freed:
            if gone.give_back is not None:
                gone.give_back()
