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
                slot. At a multiple of 128 the HCA ring holds nothing the next HCA entry reads.
Entries are found by a chain of block digests (blake2b over the previous digest and the block's tokens),
so a prompt matches the longest cached prefix of itself in one pass. Each entry holds its own references
to every page it needs (backend/memory/page_allocator.py counts them), so entries are independent and any
can be evicted: least recently used first, when pages or snapshot slots run short. A page is free only
when no request and no entry holds it.

The scheduler registers a request's state whenever a step leaves it exactly at a boundary (prefill chunks
are cut at boundaries while caching is on), and restores the longest match when it admits a request.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class CachedPrefix:
    digest: bytes
    length: int  # P, positions
    window_first: int  # logical page of window_pages[0]
    window_pages: list[int]
    compressed: dict[str, list[int]]  # pool -> pages of logical pages [0, n)
    snapshot: int  # slot in the snapshot tensors
    last_used: int = 0


@dataclass
class PrefixCacheStats:
    hits: int = 0  # requests that started after a cached prefix
    cached_tokens: int = 0  # prompt positions served from the cache
    evictions: int = 0
    registered: int = 0


class PrefixCache:
    STREAMS = ("csa", "indexer")  # compressor rings a continuation reads (see the module docstring)

    def __init__(self, kv, block_tokens: int, max_entries: int):
        if block_tokens % 128 or block_tokens % kv.page_size:
            raise ValueError(f"prefix cache blocks of {block_tokens} tokens: must be a multiple of 128 and of the "
                             f"page size {kv.page_size}")
        self.kv, self.block_tokens, self.max_entries = kv, block_tokens, max_entries
        state = kv.state_pool
        self._snapshots = {stream: tuple(_like_slots(rings[stream], max_entries) for rings in (state.kv, state.gate))
                           for stream in self.STREAMS if stream in state.kv}
        self._free_snapshots = list(range(max_entries - 1, -1, -1))
        self._entries: dict[bytes, CachedPrefix] = {}
        self._clock = itertools.count(1)
        self.stats = PrefixCacheStats()

    # --- lookup -------------------------------------------------------------------------------
    def digests(self, token_ids: list[int], num_blocks: int) -> list[bytes]:
        out, previous = [], b""
        for b in range(num_blocks):
            block = np.asarray(token_ids[b * self.block_tokens:(b + 1) * self.block_tokens], dtype=np.int64)
            previous = hashlib.blake2b(previous + block.tobytes(), digest_size=16).digest()
            out.append(previous)
        return out

    def lookup(self, seq) -> CachedPrefix | None:
        """The longest cached prefix of `seq`'s tokens that leaves at least one token to compute."""
        num_blocks = (seq.num_tokens - 1) // self.block_tokens
        for digest in reversed(self.digests(seq.token_ids(), num_blocks)):
            entry = self._entries.get(digest)
            if entry is not None:
                return entry
        return None

    # --- restore ------------------------------------------------------------------------------
    def restore(self, seq, entry: CachedPrefix) -> bool:
        """Give `seq` (holding no memory) the memory of `entry`; False (nothing changed) when the copies of
        the partly filled pages or the state slot cannot be allocated."""
        from backend.memory.kv_manager import RequestPages

        kv = self.kv
        partial = {name: self._is_partial(name, entry.length) for name in entry.compressed}

        def room() -> bool:  # a state slot, and a page for each partly filled page to copy
            return kv.state_pool.num_free >= 1 and all(not partial[name] or kv.compressed_pools[name].num_free >= 1
                                                       for name in partial)

        while not room():  # other entries' pages go first (this one is kept: its pages are about to be shared)
            if not self.evict_one(keep=entry):
                return False
        pages = RequestPages(kv)
        pages.slot = kv.state_pool.acquire()
        for stream, (kv_snap, gate_snap) in self._snapshots.items():
            kv.state_pool.kv[stream][:, pages.slot].copy_(kv_snap[:, entry.snapshot])
            kv.state_pool.gate[stream][:, pages.slot].copy_(gate_snap[:, entry.snapshot])
        window = pages.run("window")
        window.first, window.pages = entry.window_first, list(entry.window_pages)
        kv.window_pool.allocator.retain(entry.window_pages)
        for name, cached in entry.compressed.items():
            pool, run = kv.compressed_pools[name], pages.run(name)
            shared = cached[:-1] if partial[name] else cached
            pool.allocator.retain(shared)
            run.first, run.pages = 0, list(shared)
            if partial[name]:  # this request writes its next entries into the last page: its own copy
                (copy,) = pool.allocator.allocate(1)
                for tensor in pool.tensors.values():
                    tensor[:, copy].copy_(tensor[:, cached[-1]])
                run.pages.append(copy)
        seq.pages = pages
        kv.track(pages)
        seq.num_computed_tokens = entry.length
        entry.last_used = next(self._clock)
        return True

    def record_hit(self, num_tokens: int) -> None:
        """A request restored from the cache was admitted (a restore undone before admission is no hit)."""
        self.stats.hits += 1
        self.stats.cached_tokens += num_tokens

    def _is_partial(self, name: str, length: int) -> bool:
        pool = self.kv.compressed_pools[name]
        return (length // pool.compress_rate) % pool.page_size != 0

    # --- register -----------------------------------------------------------------------------
    def register(self, seq) -> None:
        """After a step: when `seq` stands exactly at a block boundary, keep its state there (if new)."""
        length = seq.num_computed_tokens
        if length == 0 or length % self.block_tokens or seq.pages is None or seq.pages.slot is None:
            return
        digest = self.digests(seq.token_ids(), length // self.block_tokens)[-1]
        if digest in self._entries:
            self._entries[digest].last_used = next(self._clock)
            return
        if not self._free_snapshots and not self.evict_one():
            return
        kv, pages = self.kv, seq.pages
        window_first = kv.window_pool.first_needed_page(length)
        run = pages.run("window")
        window_pages = run.pages[window_first - run.first:length // kv.page_size - run.first]
        compressed = {}
        for name, pool in kv.compressed_pools.items():
            needed = pool.pages_for_tokens(length)
            compressed[name] = pages.run(name).pages[:needed]
        snapshot = self._free_snapshots.pop()
        for stream, (kv_snap, gate_snap) in self._snapshots.items():
            kv_snap[:, snapshot].copy_(kv.state_pool.kv[stream][:, pages.slot])
            gate_snap[:, snapshot].copy_(kv.state_pool.gate[stream][:, pages.slot])
        kv.window_pool.allocator.retain(window_pages)
        for name, cached in compressed.items():
            kv.compressed_pools[name].allocator.retain(cached)
        self._entries[digest] = CachedPrefix(digest, length, window_first, window_pages, compressed, snapshot,
                                             next(self._clock))
        self.stats.registered += 1

    # --- eviction -----------------------------------------------------------------------------
    def evict_one(self, keep: CachedPrefix | None = None) -> bool:
        """Drop the least recently used entry (never `keep`); False when there is none."""
        candidates = [e for e in self._entries.values() if e is not keep]
        if not candidates:
            return False
        entry = min(candidates, key=lambda e: e.last_used)
        del self._entries[entry.digest]
        self.kv.window_pool.allocator.free(entry.window_pages)
        for name, cached in entry.compressed.items():
            self.kv.compressed_pools[name].allocator.free(cached)
        self._free_snapshots.append(entry.snapshot)
        self.stats.evictions += 1
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def snapshot_stats(self) -> dict:
        """For engine.stats(): hits, positions served, evictions, entries, and distinct pages entries hold."""
        pools = [self.kv.window_pool.name, *self.kv.compressed_pools]
        pages = {pool: len({p for held in self.held_pages(pool) for p in held}) for pool in pools}
        return {"hits": self.stats.hits, "cached_tokens": self.stats.cached_tokens,
                "evictions": self.stats.evictions, "entries": len(self._entries), "pages": pages}

    def held_pages(self, pool: str) -> list[list[int]]:
        """The page lists the entries hold in `pool` (for KVCacheManager.check)."""
        if pool == "window":
            return [e.window_pages for e in self._entries.values()]
        return [e.compressed[pool] for e in self._entries.values()]

    def pages_only_cached(self) -> dict[str, int]:
        """Pages per pool that only cache entries hold (what eviction would give back)."""
        kv = self.kv
        out = {}
        for pool in [kv.window_pool, *kv.compressed_pools.values()]:
            held = {p for pages in self.held_pages(pool.name) for p in pages}
            by_requests = {p for r in kv.live_handles() for p in r.runs.get(pool.name, _EMPTY).pages}
            out[pool.name] = len(held - by_requests)
        return out


def _like_slots(rings: torch.Tensor, num: int) -> torch.Tensor:
    """Zeros shaped like the state pool's rings [layers, slots, ring, width], with `num` slots."""
    layers, _, ring, width = rings.shape
    return torch.zeros(layers, num, ring, width, dtype=rings.dtype, device=rings.device)


@dataclass
class _Empty:
    pages: list = field(default_factory=list)


_EMPTY = _Empty()
