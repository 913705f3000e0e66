"""Prefix caching for DeepSeek-V4's three memories: reuse a prompt's already-computed prefix.

A cached prefix is the state of a request at a block boundary P (a multiple of `block_tokens`, itself a
multiple of 128 and of the page size) that lets another request whose tokens start the same way continue
from P exactly as if it had computed them:
  compressed    the CSA / HCA pages holding entries [0, P / rate) (and the indexer keys): a pure function
                of the prefix's tokens. Shared by reference; the last page, when partly filled, is copied
                for the request that continues (it writes its next entries into that page);
  window        the window pages of positions [P - 127, P): the only sliding-window KV a continuation reads.
                P is a page boundary, so the continuation writes only new pages: shared by reference;
  compressor    the CSA and indexer rings at P (the projections of the last window, which the next CSA
                entry reads), copied into a snapshot slot and copied back into the continuing request's
                slot. At a multiple of 128 the HCA ring holds nothing the next HCA entry reads, so a
                boundary takes a light slot, without the HCA ring (0.9 MB against 6.1 MB at V4-Flash widths).
Besides block boundaries, the exact end of every finished request is kept (what a chat's next turn
resends): there P is anywhere, so the HCA ring (the open HCA window) is snapshotted too, in one of the full
slots (`prefix_cache_end_entries` of them), and the partly filled last window page is copied for the continuing
request, like the compressed pages.
Entries are found by a chain of block digests (blake2b over the previous digest and the block's tokens);
an end entry hangs off the digest of its last full block with the tokens after it (its tail). A prompt
matches the longest cached prefix of itself: descending through its blocks, an end entry anchored at
block k is longer than the boundary entry at k, which is longer than anything anchored before. Each entry
holds its own references to every page it needs (backend/memory/page_allocator.py counts them), so entries
are independent and any can be evicted, when pages or snapshot slots run short (an end needing a full slot
evicts an entry holding one; a boundary takes a full slot when no light one is free). A page is free only when
no request and no entry holds it.

Where a state is taken: every block boundary a step computes, inside a chunk or where it ends (a decode
reaching one included). It is reserved when the step is planned (`reserve`: a snapshot slot); inside a
chunk the step's compression plan writes the rings as they stand there into that slot
(backend/model/compressor.py), where a chunk ends the request's rings are copied there right after the
step's forward (a copy outside the forward keeps decode steps at static shapes); `keep_reserved` makes the
entry once the step's output is in. So prefill chunks need not end at boundaries,
two prompts sharing a system prompt share it whatever their chunks were, and nothing is copied from a
request's own rings after its step, when the next step (already launched) may have moved them on. A
boundary that a decode reaches has its last token still in flight when it is reserved: its digest is
computed when it is kept.

The pages are the memory manager's (backend/memory/kv_manager.py): an entry's are pinned (`pin`) and let go
(`unpin`) through it, and a restore hands them to the request (`adopt`); the scheduler counts the restored positions
computed. Copies between pages and slots (a restore's, a request end's snapshot) are not made here: they are queued
(`take_pending`) and made by whoever runs the steps, in order with them (`apply`; the engine's executor and
every worker rank), so that a copy never races a step in flight.
Eviction is least recently used. Using an entry uses every shorter boundary of the same tokens too, so a
shared prefix (a system prompt) is as recent as its latest user. Among entries used at the same time,
boundaries go before requests' ends (a chat's next turn needs its previous request's end, while a boundary
serves only prompts that leave the prefix exactly there), then the entry holding the most window pages no
other entry holds (a boundary whose window lies inside a longer entry's costs nothing to keep), then the
longest (the start of a long prompt is the likelier to be shared: a leaf of the digest tree goes before its
ancestors). Dropping an entry never breaks another: it frees its window pages and snapshot, and the
compressed pages no other holder has.
The snapshots live in the compressor-state pool's spare slots (backend/memory/compressor_state.py).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass
class PrefixPages:
    """The pages a request's state at a position P needs, held (a reference each) by a holder other than the request:
    a cache entry, or a step's reservation of one (KVCacheManager.pin)."""

    window_first: int  # logical page of window[0]
    window: list[int]  # the window of the next position; the last page partly filled when P is not a page boundary
    compressed: dict[str, list[int]]  # pool -> pages of logical pages [0, n): the entries before P

    def by_pool(self):
        """(pool name, pages) for the window pool, then each compressed pool."""
        yield "window", self.window
        yield from self.compressed.items()


@dataclass
class CachedPrefix:
    key: bytes  # the block digest (a boundary), or the digest of anchor + tail (an end)
    length: int  # P, positions
    pages: PrefixPages
    snapshot: int  # slot in the snapshot tensors
    last_used: int = 0
    anchor: bytes | None = None  # an end entry: the digest of its last full block (b"" before the first)
    tail: tuple[int, ...] = ()  # an end entry: its tokens after the anchor
    request_end: bool = False  # a request ended here (what a chat's next turn continues)
    # The token at P when the state was kept (None: not known). The MTP draft layer's window entry at P - 1, in the
    # window pages, was computed with it (a draft layer reads the next token's embedding).
    next_token: int | None = None


@dataclass
class ReservedSnapshot:
    """A block boundary inside a scheduled chunk, or where it ends, whose state the step writes into `slot`. The
    pages the entry will hold are pinned (one reference each) from the start: the request may give its own back
    (its window slides on, it is preempted or ends) before the step's output is in."""

    position: int
    key: bytes | None  # the boundary's block digest (None: its last token was not on the host yet)
    snapshot: int  # index of the snapshot
    slot: int  # the state-pool slot that holds it
    pages: PrefixPages
    # Where the chunk ends: the copy of the request's rings into the slot, made right after the step's forward
    # (the step's own copy, so a step that never runs makes none).
    copy_after: tuple | None = None


@dataclass
class PrefixCacheStats:
    hits: int = 0  # requests that started after a cached prefix
    cached_tokens: int = 0  # prompt positions served from the cache
    queried_tokens: int = 0  # positions of every new request admitted (the hit rate's denominator)
    # Preempted requests' readmissions, counted apart (as vLLM does): they mostly restore what they computed
    # themselves, and counted with new requests they would raise the hit rate as memory runs short.
    readmitted_hits: int = 0
    readmitted_cached_tokens: int = 0
    readmitted_queried_tokens: int = 0
    evictions: int = 0
    registered: int = 0


class PrefixCache:
    def __init__(self, kv, block_tokens: int, max_entries: int):
        if block_tokens % 128 or block_tokens % kv.page_size:
            raise ValueError(f"prefix cache blocks of {block_tokens} tokens: must be a multiple of 128 and of the "
                             f"page size {kv.page_size}")
        state = kv.state_pool
        if state.num_spare + state.num_light_spare != max_entries:
            raise ValueError(f"{max_entries} cache entries need as many spare compressor-state slots "
                             f"(KVCacheManager.enable_prefix_caching), the pool has "
                             f"{state.num_spare + state.num_light_spare}")
        self.kv, self.block_tokens = kv, block_tokens
        # With a draft layer in the window pool, an entry serves only a request whose token at P is the one its draft
        # entry at P - 1 was computed with: another would draft from a stale entry (its tokens still exact, its
        # drafts worse, a seeded sample's draws other than without the cache).
        self.checks_next_token = kv.num_draft_layers > 0
        self._free_full = list(range(state.num_spare - 1, -1, -1))  # snapshot indices, taken from the end
        self._free_light = list(range(max_entries - 1, state.num_spare - 1, -1))
        self._reserved_keys: set[bytes] = set()  # boundaries that steps in flight snapshot
        self._entries: dict[bytes, CachedPrefix] = {}
        self._ends: dict[bytes, list[CachedPrefix]] = {}  # anchor digest -> end entries hanging off it
        self._held: dict[str, Counter] = {}  # pool -> page -> entries holding it (the pages gauge, kept current)
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()
        self._pending: list[tuple] = []  # copies not made yet, before the next step's forward (take_pending)
        self._reserved: dict[int, ReservedSnapshot] = {}  # id -> the reservations of steps in flight

    # --- lookup -------------------------------------------------------------------------------
    def digests(self, token_ids: list[int], num_blocks: int, first: int = 0, previous: bytes = b"") -> list[bytes]:
        """The chain of block digests of blocks first .. num_blocks - 1 (`previous`: the digest of block first - 1)."""
        out = []
        for b in range(first, num_blocks):
            block = np.asarray(token_ids[b * self.block_tokens:(b + 1) * self.block_tokens], dtype=np.int64)
            previous = hashlib.blake2b(previous + block.tobytes(), digest_size=16).digest()
            out.append(previous)
        return out

    def _chain(self, seq, num_blocks: int) -> list[bytes]:
        """The digests of `seq`'s first num_blocks blocks, computed once per sequence (seq.block_digests)."""
        known = seq.block_digests
        if len(known) < num_blocks:
            known.extend(self.digests(seq.token_ids, num_blocks, len(known), known[-1] if known else b""))
        return known[:num_blocks]

    def lookup(self, seq) -> CachedPrefix | None:
        """The longest cached prefix of `seq`'s tokens that leaves at least one token to compute. Only the tokens on
        the host are hashed (a request's digests are kept: a block hashed before its last token came would stay
        wrong), so a request with tokens in flight is looked up as far as its host tokens go."""
        tokens = seq.token_ids
        limit = len(tokens) - 1
        digests = [b""] + self._chain(seq, limit // self.block_tokens)

        def continued(entry: CachedPrefix) -> bool:  # (its draft entry at P - 1 is this request's: `checks_next_token`)
            return not self.checks_next_token or entry.next_token in (None, tokens[entry.length])

        for k in range(len(digests) - 1, -1, -1):
            start = k * self.block_tokens
            ends = [e for e in self._ends.get(digests[k], []) if start + len(e.tail) <= limit
                    and tuple(tokens[start:start + len(e.tail)]) == e.tail and continued(e)]
            if ends:
                return max(ends, key=lambda e: e.length)
            if k and digests[k] in self._entries and continued(self._entries[digests[k]]):
                return self._entries[digests[k]]
        return None

    # --- restore ------------------------------------------------------------------------------
    def cached_length(self, seq) -> int:
        """The positions `match` would restore now (0: none), restoring nothing (a prefill's cost is sized by where
        its chunk starts)."""
        entry = self.lookup(seq)
        return entry.length if entry is not None else 0

    def match(self, seq) -> int:
        """Start `seq` (holding no memory, every token on the host) after the longest cached prefix of its tokens;
        the positions restored (0: none)."""
        entry = self.lookup(seq)
        return entry.length if entry is not None and self.restore(seq, entry) else 0

    def restore(self, seq, entry: CachedPrefix) -> bool:
        """Give `seq` (holding no memory) the memory of `entry` (its first entry.length positions are then computed:
        the caller counts them); False (nothing changed) when the copies of the partly filled pages or the state
        slot cannot be allocated."""
        copies = self.kv.adopt(seq, entry.pages, entry.length)
        if copies is None and not self.kv.can_adopt_evicting(entry.pages, entry.length):
            return False  # (the pages are running requests': evicting would empty the cache step after step)
        # other entries' pages go first (this one is kept: its pages are about to be shared)
        while copies is None:
            if not self.evict_one(keep=entry):
                return False
            copies = self.kv.adopt(seq, entry.pages, entry.length)
        self._do(("load", entry.snapshot, seq.pages.slot))
        for name, src, dst in copies:
            self._do(("page", name, src, dst))
        self._touch(entry, self._chain(seq, (entry.length - 1) // self.block_tokens))
        return True

    def record_admission(self, num_tokens: int, num_cached: int, readmission: bool = False) -> None:
        """A request of `num_tokens` positions was admitted (`readmission`: again, after a preemption), the first
        `num_cached` restored from the cache (a restore undone before admission is no hit)."""
        stats = self.stats
        if readmission:
            stats.readmitted_queried_tokens += num_tokens
            stats.readmitted_hits += bool(num_cached)
            stats.readmitted_cached_tokens += num_cached
        else:
            stats.queried_tokens += num_tokens
            stats.hits += bool(num_cached)
            stats.cached_tokens += num_cached

    # --- register -----------------------------------------------------------------------------
    def reserve(self, seq, start: int, end: int) -> list[ReservedSnapshot]:
        """Planning a step that computes positions [start, end) of `seq`: a snapshot slot for each new block
        boundary P with start < P <= end; the step writes its state there, `keep_reserved` (or `release_reserved`)
        follows once its output is in."""
        block = self.block_tokens
        if end // block == start // block:  # no boundary (every decode but one in `block`)
            return []
        positions = range((start // block + 1) * block, end + 1, block)
        known = len(seq.token_ids) // block  # blocks whose tokens are all on the host
        digests = self._chain(seq, min(known, positions[-1] // block))
        new = [(p, digests[p // block - 1] if p // block <= known else None) for p in positions]
        new = [(p, key) for p, key in new
               if key is None or (key not in self._entries and key not in self._reserved_keys)]
        if len(new) > self.num_free_snapshots:
            self.evict(len(new) - self.num_free_snapshots)
        reserved = []
        for position, key in new[:self.num_free_snapshots]:  # the shallowest, if slots are short
            snapshot = self._take_snapshot(full=False)
            if key is not None:
                self._reserved_keys.add(key)
            r = ReservedSnapshot(position, key, snapshot, self.kv.state_pool.spare_slot(snapshot),
                                 self.kv.pin(seq, position))
            if position == end:  # where the step ends: its rings as they stand after it, copied right after it
                r.copy_after = ("save", seq.pages.slot, snapshot)
            self._reserved[id(r)] = r
            reserved.append(r)
        return reserved

    def keep_reserved(self, seq, reserved: list[ReservedSnapshot], emitted: int | None = None) -> None:
        """The step ran, its output is in: the reserved boundaries of `seq` become entries (their rings are in their
        slots, their pages pinned), whatever became of `seq` since (it may have ended or been preempted). A boundary
        whose last token never reached the host (its request ended first) is given up. `emitted`: the token the
        step sampled after its chunk, not yet appended (the token at a boundary where the chunk ends)."""
        if not reserved:
            return
        known = min(reserved[-1].position, len(seq.token_ids)) // self.block_tokens
        digests = self._chain(seq, known)
        for r in reserved:
            block = r.position // self.block_tokens
            key = digests[block - 1] if block <= known else None
            if key is None or key in self._entries or (key != r.key and key in self._reserved_keys):
                self.release_reserved([r])  # unknown, or kept (or about to be) by another request
                continue
            self._unreserve(r)
            next_token = _token_at(seq, r.position)
            if next_token is None and r.position == len(seq.token_ids):
                next_token = emitted
            self._add_entry(key, r.position, r.snapshot, r.pages, digests[:block - 1], next_token)

    def release_reserved(self, reserved: list[ReservedSnapshot]) -> None:
        """The reserved states are void (their step failed, or an entry for them exists already)."""
        for r in reserved:
            self._unreserve(r)
            self._give_snapshot(r.snapshot)
            self.kv.unpin(r.pages)

    def _unreserve(self, r: ReservedSnapshot) -> None:
        del self._reserved[id(r)]
        if r.key is not None:
            self._reserved_keys.discard(r.key)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def register_end(self, seq, length: int) -> None:
        """When `seq` finishes, its last step having computed `length` positions: keep its state there (the next
        turn of a chat resends all of it), marked as a request's end; at a block boundary the step kept it
        already. (A step launched meanwhile may have computed one more position, its last token: a continuation
        from `length` reads none of what that wrote.)"""
        if length == 0 or seq.pages is None or seq.pages.slot is None:
            return
        tokens = seq.token_ids
        full = length // self.block_tokens
        digests = self._chain(seq, full)
        if length % self.block_tokens == 0:
            if digests[-1] in self._entries:
                self._entries[digests[-1]].request_end = True
            return
        anchor = digests[-1] if full else b""
        tail = tuple(tokens[full * self.block_tokens:length])
        key = hashlib.blake2b(anchor + np.asarray(tail, dtype=np.int64).tobytes(), digest_size=16,
                              person=b"end").digest()
        entry = self._keep(seq, key, length, digests)
        if entry is not None and entry.anchor is None:
            entry.anchor, entry.tail, entry.request_end = anchor, tail, True
            self._ends.setdefault(anchor, []).append(entry)

    def _keep(self, seq, key: bytes, length: int, ancestors: list[bytes]) -> CachedPrefix | None:
        """The entry under `key` (touched), or a new one holding `seq`'s state at `length` in a full snapshot slot
        (its rings copied there); `ancestors`: the digests of the block boundaries before it."""
        if key in self._entries:
            self._touch(self._entries[key], ancestors)
            return self._entries[key]
        if not self._free_full and self.evict(1, full_only=True) == 0:
            return None
        snapshot = self._take_snapshot(full=True)
        self._do(("save", seq.pages.slot, snapshot))
        return self._add_entry(key, length, snapshot, self.kv.pin(seq, length), ancestors, _token_at(seq, length))

    def _add_entry(self, key: bytes, length: int, snapshot: int, pages: PrefixPages,
                   ancestors: list[bytes], next_token: int | None) -> CachedPrefix:
        """An entry for a state at `length` (its rings in `snapshot`), holding the pages given (pinned for it)."""
        entry = self._entries[key] = CachedPrefix(key, length, pages, snapshot, next_token=next_token)
        self._touch(entry, ancestors)
        for pool, held in pages.by_pool():
            self._held.setdefault(pool, Counter()).update(held)
        self.stats.registered += 1
        return entry

    def _touch(self, entry: CachedPrefix, ancestors: list[bytes]) -> None:
        """`entry` was used, and so were the boundaries of the same tokens before it (digests `ancestors`):
        all at the same time."""
        now = next(self._clock)
        entry.last_used = now
        for digest in ancestors:
            if digest in self._entries:
                self._entries[digest].last_used = now

    # --- snapshot slots -------------------------------------------------------------------------
    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_full) + len(self._free_light)

    def _take_snapshot(self, full: bool) -> int:
        """A free snapshot slot (the caller made sure there is one): full if asked for, else light if any is free."""
        return self._free_light.pop() if not full and self._free_light else self._free_full.pop()

    def _give_snapshot(self, snapshot: int) -> None:
        (self._free_light if self.kv.state_pool.is_light(snapshot) else self._free_full).append(snapshot)

    # --- tensor copies (replayed by the other ranks) ----------------------------------------------
    def _do(self, op: tuple) -> None:
        self._pending.append(op)

    def take_pending(self) -> list[tuple]:
        """The copies asked for since the last call, in order: the next step makes them before its forward, on
        every rank (the states where its chunks end it copies after it: ReservedSnapshot.copy_after)."""
        ops, self._pending = self._pending, []
        return ops

    def requeue_saves(self, ops: list[tuple]) -> None:
        """`ops` were taken for a step that was never launched (building it failed): their snapshot saves go first in
        the next step's copies, since the entries they fill are already matchable (a request that ended at an earlier
        take-in); their restores and page copies served that step's own requests, which fail with it."""
        self._pending = [op for op in ops if op[0] == "save"] + self._pending

    def apply(self, ops: list[tuple]) -> None:
        """Make these copies in this rank's pools: ("page", pool, src, dst), ("save", slot, snapshot),
        ("load", snapshot, slot)."""
        state = self.kv.state_pool
        for op in ops:
            if op[0] == "page":
                _, name, src, dst = op
                pool = self.kv.paged_pool(name)
                for tensor in pool.tensors.values():
                    tensor[:, dst].copy_(tensor[:, src])
            elif op[0] == "save":
                state.copy_slot(op[1], state.spare_slot(op[2]))
            else:
                state.copy_slot(state.spare_slot(op[1]), op[2])

    # --- eviction -----------------------------------------------------------------------------
    def evict_one(self, keep: CachedPrefix | None = None) -> bool:
        """Drop the first entry in eviction order (never `keep`); False when there is none."""
        return self.evict(1, keep) == 1

    def evict(self, count: int, keep: CachedPrefix | None = None, full_only: bool = False) -> int:
        """Drop up to `count` entries (never `keep`; only those in full snapshot slots if `full_only`), in eviction
        order: least recently used first; among equals a boundary before a request's end, the one holding the most
        window pages no other entry holds, then the longest. Returns how many went."""
        held = self._held.get(self.kv.window_pool.name, {})

        held_count = held.get

        def order(e: CachedPrefix) -> tuple:
            # pages a longer entry holds too cost nothing to keep; running requests are not counted: they give
            # their window pages back as they advance
            own_window_pages = 0
            for page in e.pages.window:  # (a loop, not a generator: ties can be the whole cache)
                own_window_pages += held_count(page) == 1
            return e.last_used, e.request_end, -own_window_pages, -e.length

        state = self.kv.state_pool
        candidates = [e for e in self._entries.values()
                      if e is not keep and not (full_only and state.is_light(e.snapshot))]
        if len(candidates) > count:  # the full order only among the least recently used (it counts pages)
            cutoff = heapq.nsmallest(count, (e.last_used for e in candidates))[-1]
            candidates = [e for e in candidates if e.last_used <= cutoff]
        victims = heapq.nsmallest(count, candidates, key=order)
        for entry in victims:
            self._drop(entry)
        return len(victims)

    def _drop(self, entry: CachedPrefix) -> None:
        del self._entries[entry.key]
        if entry.anchor is not None:
            self._ends[entry.anchor].remove(entry)
            if not self._ends[entry.anchor]:
                del self._ends[entry.anchor]
        self.kv.unpin(entry.pages)
        for pool, pages in entry.pages.by_pool():
            held = self._held[pool]
            held.subtract(pages)
            for page in [page for page in pages if not held[page]]:
                del held[page]
        self._give_snapshot(entry.snapshot)
        self.stats.evictions += 1

    def clear(self) -> None:
        while self.evict_one():
            pass

    def holders(self, pool: str) -> Mapping[int, int]:
        """Page -> the entries holding it, of `pool`'s pages the cache holds."""
        return self._held.get(pool, {})

    # --- accounting ---------------------------------------------------------------------------
    def snapshot_stats(self) -> dict:
        """For engine.stats(): hits, positions served and queried (new requests, then readmissions apart),
        evictions, entries, and distinct pages entries hold."""
        pools = [self.kv.window_pool.name, *self.kv.compressed_pools]
        stats = self.stats
        return {"hits": stats.hits, "cached_tokens": stats.cached_tokens, "queried_tokens": stats.queried_tokens,
                "readmitted_hits": stats.readmitted_hits, "readmitted_cached_tokens": stats.readmitted_cached_tokens,
                "readmitted_queried_tokens": stats.readmitted_queried_tokens, "evictions": stats.evictions,
                "entries": len(self._entries), "pages": {pool: len(self._held.get(pool, ())) for pool in pools}}

    def held_pages(self, pool: str) -> list[list[int]]:
        """The page lists the entries, and the reservations of steps in flight, hold in `pool` (for
        KVCacheManager.check)."""
        holders = [*self._entries.values(), *self._reserved.values()]
        return [h.pages.window if pool == "window" else h.pages.compressed[pool] for h in holders]


def _token_at(seq, position: int) -> int | None:
    """`seq`'s token at `position`, where the host has it."""
    return seq.token_ids[position] if position < len(seq.token_ids) else None
