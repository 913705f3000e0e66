"""All of a deployment's paged memory, behind the interface the scheduler and the model use.

Sizing (EngineConfig): `num_tokens` positions across all requests for the compressed pools
(num_tokens / 4 CSA entries, num_tokens / 128 HCA entries), plus one page per pool for each of
`max_running_requests` (a request's last page is partly empty: with 64-entry pages one HCA page
covers 8192 positions, and 32 short requests would otherwise need 32 pages of a pool sized for a
few), `num_tokens * swa_full_tokens_ratio` positions for the sliding-window pool, `page_size` slots
per page, and one compressor-state slot per running request. "Tokens" always mean positions in
the full sequence.

Ownership: a request's pages and its compressor-state slot live in its `RequestPages` handle
(`seq.pages`), created by the first `try_extend` (or a prefix-cache restore) and given back by `free`,
the one way a request's memory is released (preemption, the end of the request). The scheduler
decides when; this module only does the arithmetic and the bookkeeping. The model reads the tensors
of one layer through `layer(i)`.

Block tables: every paged pool keeps a host table with one row per compressor-state slot (a running
request's row, the scratch slot's row for padding) holding the physical page of each logical page.
A row is written where pages are added (`try_extend`, a restore), never rebuilt, so a step gathers its
rows (`block_table`) in time that does not grow with the requests' contexts. Compressed pools index a
row by logical page; the window pool, whose pages slide, by logical page modulo the row's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.memory.compressed_pool import CompressedPool
from backend.memory.compressor_state import CompressorStatePool
from backend.memory.page_allocator import OutOfPages
from backend.memory.paged_pool import PagedPool, PageRun
from backend.memory.prefix_cache import PrefixCache, PrefixPages
from backend.memory.window_pool import WindowPool
from backend.model.config import CSA, HCA, ModelConfig
from kernels.modes import KVLayout


@dataclass(eq=False)
class RequestPages:
    """One request's memory: a page run per paged pool and its compressor-state slot (released by
    KVCacheManager.free)."""

    runs: dict[str, PageRun] = field(default_factory=dict)
    slot: int | None = None
    # Positions below this compute into pages the runs hold, and leave the window's first page needed: a decode
    # there allocates and releases nothing (KVCacheManager.try_extend's fast path). 0: not known.
    quiet_until: int = 0

    def run(self, pool: str) -> PageRun:
        return self.runs.setdefault(pool, PageRun())


@dataclass
class LayerMemory:
    """The tensors one layer reads and writes (views into the pools; None where the layer has none), and how they
    store entries.

    window_kv [pages, page_size, Dh]; compressed_kv [pages, page_size, Dh] and index_k
    [pages, page_size, Di] for CSA, compressed_kv for HCA (in the fp8 layout: uint8, the entries' bytes,
    kv_layout.entry_width / index_key_width of them); `pool` names the compressed pool;
    `state[stream] = (kv ring, gate ring)`, each [slots, ring, width], for the layer's compressors.
    """

    window_kv: torch.Tensor
    kv_layout: KVLayout
    pool: str | None = None
    compress_rate: int = 0
    compressed_kv: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    state: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def model_kv_layout(model: ModelConfig, dtype: torch.dtype, fp8: bool = False) -> KVLayout:
    """The layout of `model`'s entries in the pools: values in `dtype`, or DeepSeek's fp8 bytes."""
    widths = dict(head_dim=model.head_dim, rope_dim=model.qk_rope_head_dim, index_head_dim=model.index_head_dim)
    return KVLayout.deepseek_fp8(**widths) if fp8 else KVLayout.values(dtype, **widths)


def _pages(entries: int, page_size: int, partial_pages: int) -> int:
    """Pages for `entries` entries plus one partly filled page per running request."""
    return -(-entries // page_size) + partial_pages


class KVCacheManager:
    def __init__(self, model: ModelConfig, *, num_tokens: int, swa_full_tokens_ratio: float, page_size: int,
                 max_running_requests: int, dtype: torch.dtype, device: str | torch.device,
                 max_step_tokens: int | None = None, kv_layout: KVLayout | None = None,
                 state_dtype: torch.dtype | None = None, draft_layers: int = 0, speculative_tokens: int = 0):
        """`max_step_tokens`: the most tokens one request computes in a step (bounds a window run's length,
        hence the window table's width; None: the whole window pool). `kv_layout`: how the paged pools store
        entries (kernels/modes.py; None: values in `dtype`). `state_dtype`: the compressor rings' (None: `dtype`;
        DeepSeek's numerics keep them in fp32, as its compressors run). `draft_layers`: the checkpoint's MTP layers
        served as speculative drafts (sliding-window layers: a layer more in the window pool each).
        `speculative_tokens` (k): a decode computes up to 1 + k positions and its draft chain writes k - 1 more (the
        window's lookahead), and every compressor ring keeps k positions more than its windows read, so that the ring
        writes of rejected draft positions only ever overwrite positions no continuation reads: rolling a request back
        is moving its position, never a copy (backend/speculative.py). With one draft a verify may be scheduled as if
        the one in flight accepted it (overlapped verify steps): a request may then fall back k positions behind its
        position and hold pages 3k - 1 past it, and the rings keep 2k positions more."""
        self.model = model
        self.page_size = page_size
        self.window = model.sliding_window
        self.kv_layout = layout = kv_layout or model_kv_layout(model, dtype)
        entry, index_key, pool_dtype = layout.entry_width, layout.index_key_width, layout.dtype
        csa_layers, hca_layers = len(model.layers_of_type(CSA)), len(model.layers_of_type(HCA))
        window_pages = max(1, int(num_tokens * swa_full_tokens_ratio) // page_size)
        self.num_main_layers, self.speculative_tokens = model.num_hidden_layers, speculative_tokens
        self.num_draft_layers = draft_layers
        ahead = speculative_tokens if speculative_tokens == 1 else 0  # (overlapped verify steps: one draft a row)
        self._lookbehind = ahead  # window positions a request keeps behind its own (try_extend)
        self.window_pool = WindowPool(model.num_hidden_layers + draft_layers, window_pages, page_size, entry,
                                      model.sliding_window, pool_dtype, device,
                                      decode_lookahead=max(0, 2 * speculative_tokens - 1 + ahead))
        self.compressed_pools: dict[str, CompressedPool] = {}
        if csa_layers:
            self.compressed_pools["csa"] = CompressedPool(
                "csa", model.csa_rate, csa_layers, _pages(num_tokens // model.csa_rate, page_size, max_running_requests),
                page_size, {"kv": entry, "index_k": index_key}, pool_dtype, device)
        if hca_layers:
            self.compressed_pools["hca"] = CompressedPool(
                "hca", model.hca_rate, hca_layers, _pages(num_tokens // model.hca_rate, page_size, max_running_requests),
                page_size, {"kv": entry}, pool_dtype, device)
        slack = speculative_tokens + ahead  # ring positions beyond the windows' span (see above)
        self._state_rings = {
            "csa": (csa_layers, 2 * model.csa_rate + slack, 2 * model.head_dim),
            "indexer": (csa_layers, 2 * model.csa_rate + slack, 2 * model.index_head_dim),
            "hca": (hca_layers, model.hca_rate + slack, model.head_dim),
        }
        self.state_pool = CompressorStatePool(max_running_requests, self._state_rings, state_dtype or dtype, device)
        self._pools: list[PagedPool] = [self.window_pool, *self.compressed_pools.values()]
        self._layers = [self._layer_memory(i) for i in range(self.window_pool.num_layers)]
        self._live: set[RequestPages] = set()  # handles holding anything, for check()
        self.prefix_cache = None  # backend/memory/prefix_cache.py, when enabled
        rows = max_running_requests + 1  # a row per slot, and the scratch slot's (padding rows)
        # (numpy: a step gathers its rows with a few array operations, cheaper in numpy than in torch at these sizes)
        self.tables = {pool.name: np.zeros((rows, self._table_width(pool, max_step_tokens)), dtype=np.int32)
                       for pool in self._pools}
        for pool in self._pools:
            self.tables[pool.name][self.state_pool.scratch_slot] = pool.scratch_page

    def _table_width(self, pool: PagedPool, max_step_tokens: int | None) -> int:
        """Columns of a pool's table: the most logical pages one request's run can span."""
        if pool is self.window_pool:
            if max_step_tokens is None:
                return pool.num_pages
            # (beyond a step's tokens: a prompt's last chunk also holds its draft chain's k - 1 positions, a decode
            # its chain's, and the positions kept behind; + 1: a run that starts mid-page)
            reach = max_step_tokens + self.window_pool.decode_lookahead + self._lookbehind + self.window
            return min(pool.num_pages, -(-reach // self.page_size) + 1)
        return min(pool.num_pages, pool.pages_for_tokens(self.model.max_position_embeddings) + 1)

    def enable_prefix_caching(self, block_tokens: int, max_entries: int, max_end_entries: int | None = None) -> None:
        """Before any request: the state pool gets `max_entries` spare slots, where the cache keeps its ring
        snapshots: `max_end_entries` (default: all) full ones, which a request's end needs, and light ones holding
        only the rings a continuation from a block boundary reads."""
        assert not self._live and self.prefix_cache is None, "enable prefix caching before serving"
        max_end_entries = max_entries if max_end_entries is None else max_end_entries
        assert 0 <= max_end_entries <= max_entries, (max_end_entries, max_entries)
        old = self.state_pool
        self.state_pool = CompressorStatePool(old.allocator.num_pages, self._state_rings, old.dtype, old.device,
                                              num_spare=max_end_entries, num_light_spare=max_entries - max_end_entries,
                                              light_streams=self._streams_read_at(block_tokens))
        self._layers = [self._layer_memory(i) for i in range(self.window_pool.num_layers)]
        self.prefix_cache = PrefixCache(self, block_tokens, max_entries)

    def _streams_read_at(self, block_tokens: int) -> frozenset[str]:
        """The compressor streams whose rings a continuation from a multiple of `block_tokens` reads: CSA and its
        indexer (overlapping windows: the last closed window), HCA only if its windows do not close there."""
        streams = {"csa", "indexer"}
        if block_tokens % self.model.hca_rate:
            streams.add("hca")
        return frozenset(streams)

    # --- the prefix cache's interface ------------------------------------------------------------------
    def pin(self, seq, length: int) -> PrefixPages:
        """The pages a state of `seq` at `length` needs (the window of the next position, the compressed entries
        before it), each with one reference more, for a holder other than `seq`."""
        runs = seq.pages.runs
        window_first = self.window_pool.first_needed_page(length)
        run = runs["window"]
        window = run.pages[window_first - run.first:-(-length // self.page_size) - run.first]
        assert window_first >= run.first and len(window) == -(-length // self.page_size) - window_first, \
            "the window pages of a prefix state are held"
        pinned = PrefixPages(window_first, window, {
            name: runs[name].pages[:pool.pages_for_tokens(length)] if name in runs else []
            for name, pool in self.compressed_pools.items()})
        for name, pages in pinned.by_pool():
            self.paged_pool(name).allocator.retain(pages)
        return pinned

    def unpin(self, pinned: PrefixPages) -> None:
        """Its holder lets go of `pinned`: a reference less on each page (freed where it was the last)."""
        for name, pages in pinned.by_pool():
            self.paged_pool(name).allocator.free(pages)

    def adopt(self, seq, pinned: PrefixPages, length: int) -> list[tuple[str, int, int]] | None:
        """`seq` (holding no memory) continues from `length` positions with the pages of `pinned`: a state slot of
        its own, the pages shared by reference but a partly filled last one (the request writes its next slots
        there), which it gets a page of its own for. Returns the page copies (pool, from, to) the caller makes before
        the request's next step; None, nothing changed, when the slot or a page is short. The token counts are the
        scheduler's."""
        partial = {name: self._last_page_partial(name, length) for name, _ in pinned.by_pool()}
        if self.state_pool.num_free < 1 or any(partial[name] and self.paged_pool(name).num_free < 1
                                               for name in partial):
            return None
        pages = seq.pages = RequestPages(slot=self.state_pool.acquire())
        copies = []
        for name, cached in pinned.by_pool():
            pool, run = self.paged_pool(name), pages.run(name)
            run.first = pinned.window_first if pool is self.window_pool else 0
            run.pages = cached[:-1] if partial[name] else list(cached)
            pool.allocator.retain(run.pages)
            if partial[name]:
                (copy,) = pool.allocator.allocate(1)
                copies.append((name, cached[-1], copy))
                run.pages.append(copy)
            self._write_table(name, pages.slot, run, 0)
        self._live.add(pages)
        return copies

    def paged_pool(self, name: str) -> PagedPool:
        return self.window_pool if name == self.window_pool.name else self.compressed_pools[name]

    def _last_page_partial(self, pool: str, length: int) -> bool:
        """Whether the state at `length` leaves the last of its pages of `pool` partly filled."""
        if pool == self.window_pool.name:
            return length % self.page_size != 0
        compressed = self.compressed_pools[pool]
        return (length // compressed.compress_rate) % compressed.page_size != 0

    # --- the model's interface ---------------------------------------------------------------------
    def ring_length(self, stream: str) -> int:
        """Positions a compressor ring of `stream` ("csa", "indexer", "hca") keeps."""
        return self._state_rings[stream][1]

    def _layer_memory(self, i: int) -> LayerMemory:
        memory = LayerMemory(window_kv=self.window_pool.kv[i], kv_layout=self.kv_layout)
        if i >= self.num_main_layers:  # a draft (MTP) layer: sliding window only
            return memory
        layer_type = self.model.layer_types[i]
        kind = {CSA: "csa", HCA: "hca"}.get(layer_type)
        if kind is None:
            return memory
        pool = self.compressed_pools[kind]
        ordinal = self.model.layers_of_type(layer_type).index(i)  # the layer's slice of its pools
        memory.pool, memory.compress_rate = kind, pool.compress_rate
        memory.compressed_kv = pool.tensors["kv"][ordinal]
        if "index_k" in pool.tensors:
            memory.index_k = pool.tensors["index_k"][ordinal]
        streams = ("csa", "indexer") if kind == "csa" else ("hca",)
        memory.state = {s: (self.state_pool.kv[s][ordinal], self.state_pool.gate[s][ordinal]) for s in streams}
        return memory

    def layer(self, i: int) -> LayerMemory:
        return self._layers[i]

    def has_pool(self, name: str) -> bool:
        return name in self.compressed_pools

    def block_table(self, pool: str, slots: np.ndarray, firsts: np.ndarray, lengths: np.ndarray, width: int,
                    pad: int) -> np.ndarray:
        """[B, width] int32: row b holds the pages of logical pages firsts[b] .. firsts[b] + lengths[b] - 1 of the
        request in slot slots[b] (`pad` after them), gathered from the pool's table (no per-row Python)."""
        table = self.tables[pool]
        slots, firsts, lengths = np.asarray(slots), np.asarray(firsts), np.asarray(lengths)
        if pool == self.window_pool.name:  # a ring: logical page j in column j % width
            rows = table[slots[:, None], (firsts[:, None] + np.arange(width)[None, :]) % table.shape[1]]
        else:  # logical page j in column j: the rows' first columns, one copy
            rows = table[slots, :width]
            if width > table.shape[1]:  # (a static shape may address more pages than a request can hold)
                rows = np.concatenate([rows, np.full((len(slots), width - table.shape[1]), pad, np.int32)], axis=1)
        rows[np.arange(width)[None, :] >= lengths[:, None]] = pad
        return rows

    def _write_table(self, pool: str, slot: int, run: PageRun, from_index: int) -> None:
        """Row `slot` of the pool's table gets the run's pages from index `from_index` on."""
        table = self.tables[pool]
        width = table.shape[1]
        for index in range(from_index, len(run.pages)):
            table[slot, (run.first + index) % width] = run.pages[index]

    # --- the scheduler's interface -------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return self.state_pool.num_free > 0

    def _page_needs(self, seq, num_new_tokens: int) -> list[int]:
        """New pages each paged pool must give for positions [num_computed, + num_new_tokens)."""
        start, pages = seq.num_computed_tokens, seq.pages
        if pages is None:
            return [pool.pages_needed(None, start, num_new_tokens) for pool in self._pools]
        runs = pages.runs
        return [pool.pages_needed(runs.get(pool.name), start, num_new_tokens) for pool in self._pools]

    def _fits(self, seq, needs: list[int], freeable: dict[str, int] | None = None) -> bool:
        """Whether `needs` (pages a pool) fit what the pools have free (and `freeable`: pages a pool an eviction
        would free), and a slot where `seq` holds none."""
        if (seq.pages is None or seq.pages.slot is None) and self.state_pool.num_free == 0:
            return False
        for pool, need in zip(self._pools, needs):
            if need > pool.num_free + (freeable or {}).get(pool.name, 0):
                return False
        return True

    def can_extend(self, seq, num_new_tokens: int) -> bool:
        return self._fits(seq, self._page_needs(seq, num_new_tokens))

    def try_extend(self, seq, num_new_tokens: int) -> bool:
        """Allocate pages for tokens [num_computed, num_computed + n) (the first call also takes a slot); all or
        nothing: False, and nothing changed, when a pool (or the slots) is short. The window pages before the
        window of num_computed - lookbehind are released first: no step scheduled from now on reads them (a step in
        flight may, but it runs before any step that could write them again; with one draft a row, a verify scheduled
        ahead of the one in flight falls back a position when that one's draft is rejected: overlapped verify
        steps)."""
        pages, start = seq.pages, seq.num_computed_tokens
        if pages is not None and start + num_new_tokens <= pages.quiet_until:  # most decodes: nothing changes
            return True
        self.release_slid_out(seq, max(0, start - self._lookbehind))
        needs = self._page_needs(seq, num_new_tokens)
        if not self._fits(seq, needs):
            return False
        if pages is None:
            pages = seq.pages = RequestPages()
        if pages.slot is None:
            pages.slot = self.state_pool.acquire()
            self._live.add(pages)
        for pool, need in zip(self._pools, needs):
            if need or pool.name not in pages.runs:
                run = pages.run(pool.name)
                held = len(run.pages)
                pool.extend(run, start, num_new_tokens)
                self._write_table(pool.name, pages.slot, run, held)
        pages.quiet_until = self._quiet_until(pages)
        return True

    def _quiet_until(self, pages: RequestPages) -> int:
        """The first position whose computation changes the runs: a new page in some pool, or the window sliding off
        its first page."""
        page_size, window = self.page_size, pages.runs["window"]
        limit = min(window.end * page_size, (window.first + 1) * page_size + self.window - 1)
        for name, pool in self.compressed_pools.items():
            run = pages.runs.get(name)  # entry e is in page e // page_size; position p completes entry (p + 1) // r - 1
            limit = min(limit, ((len(run.pages) if run is not None else 0) * page_size + 1) * pool.compress_rate - 1)
        return limit

    def extend(self, seq, num_new_tokens: int) -> None:
        """try_extend, raising OutOfPages (naming the short pool) when it cannot."""
        if not self.try_extend(seq, num_new_tokens):
            short = [(p.name, need, p.num_free) for p, need in zip(self._pools,
                                                                   self._page_needs(seq, num_new_tokens))
                     if need > p.num_free]
            raise OutOfPages(*(short[0] if short else ("compressor_state", 1, 0)))

    def release_slid_out(self, seq, next_pos: int | None = None) -> None:
        """`seq` computes from `next_pos` on (default: its computed tokens): drop the window pages no later token
        can attend to (a step in flight may still read them: it runs before any step that could write them)."""
        if seq.pages is not None:
            next_pos = seq.num_computed_tokens if next_pos is None else next_pos
            run = seq.pages.runs.get("window")
            if run is not None:
                self.window_pool.release_slid_out(run, next_pos)
                seq.pages.quiet_until = 0

    def free(self, seq) -> None:
        """Give back every page and the compressor-state slot `seq` holds (preemption, the end of a request);
        idempotent. The one way a request's memory is released."""
        pages, seq.pages = seq.pages, None
        if pages is None:
            return
        for pool in self._pools:
            if pool.name in pages.runs:
                pool.free(pages.runs[pool.name])
        if pages.slot is not None:
            self.state_pool.release(pages.slot)
            pages.slot = None
        self._live.discard(pages)

    def max_request_positions(self) -> int:
        """The most positions one request may hold: what it can reach running alone in an empty engine.

        The one capacity rule of admission (engine.submit): a request needs prompt + max_tokens - 1
        positions (the last sampled token is never fed back). 0 when the window pool cannot even
        hold one window.
        """
        if self.window_pool.pages_per_running_request() > self.window_pool.num_pages:
            return 0  # one-token chunks need the window plus one page
        limits = [pool.positions_held() + pool.compress_rate - 1 for pool in self.compressed_pools.values()]
        # Speculative decoding: the last verify step's draft chain may reach k - 1 positions past the request's end.
        return max(0, min(limits + [self.model.max_position_embeddings]) - max(0, self.speculative_tokens - 1))

    def derived_prefill_chunk_tokens(self, max_running_requests: int) -> int:
        """Chunk budget from the window pool, as in the seed bug report's engine.

        free = window pages - max_running_requests * pages_per_running_request; the chunk gets the
        free pages, less the pages its own window (the `window` positions before it) occupies:
            chunk = (free - ceil(window / page_size)) * page_size, at least one page.
        """
        free = self.window_pool.num_pages - max_running_requests * self.window_pool.pages_per_running_request()
        chunk_pages = free - -(-self.window // self.page_size)
        return max(self.page_size, chunk_pages * self.page_size)

    def usage(self) -> dict[str, float]:
        return {name: used / total for name, (used, total) in self._page_counts().items()}

    def pages_used(self) -> dict[str, int]:
        return {name: used for name, (used, _) in self._page_counts().items()}

    def pages_held_by_requests(self) -> dict[str, int]:
        """Pool -> pages (state slots) live requests hold, a shared page once: 0 everywhere when nothing runs.
        The rest of pages_used() is the prefix cache's alone, evicted whenever pages are needed."""
        held = {pool.name: len({page for pages in self._live for page in pages.runs.get(pool.name, PageRun()).pages})
                for pool in self._pools}
        held[self.state_pool.name] = sum(pages.slot is not None for pages in self._live)
        return held

    def _page_counts(self) -> dict[str, tuple[int, int]]:
        allocators = [p.allocator for p in self._pools] + [self.state_pool.allocator]
        return {a.name: (a.num_used, a.num_pages) for a in allocators}

    # --- capacity report -----------------------------------------------------------------------
    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one sequence position costs in each pool (compressed pools amortise over their rate)."""
        out = {"window": self.window_pool.bytes_per_page() / self.page_size}
        for pool in self.compressed_pools.values():
            out[pool.name] = pool.bytes_per_page() / (self.page_size * pool.compress_rate)
        return out

    def capacity(self) -> dict[str, int]:
        """Positions each pool can hold across all requests."""
        out = {"window": self.window_pool.num_pages * self.page_size}
        for pool in self.compressed_pools.values():
            out[pool.name] = pool.positions_held()
        out["running_requests"] = self.state_pool.allocator.num_pages
        return out

    def evictable_pages(self, keep: PrefixPages | None = None) -> dict[str, int] | None:
        """Pool -> its pages no request holds, only prefix-cache entries: what evicting every entry (but the one
        holding `keep`) would free (None without a prefix cache). It walks every page the cache holds."""
        if self.prefix_cache is None:
            return None
        kept = {name: set(pages) for name, pages in keep.by_pool()} if keep is not None else {}
        return {pool.name: sum(1 for page, count in self.prefix_cache.holders(pool.name).items()
                               if pool.allocator.refs(page) == count and page not in kept.get(pool.name, ()))
                for pool in self._pools}

    def can_adopt_evicting(self, pinned: PrefixPages, length: int) -> bool:
        """Whether `adopt(seq, pinned, length)` could succeed once every other prefix-cache entry were evicted: a free
        state slot (entries hold none), and a page for each partly filled last page, free or only entries' (not
        `pinned`'s, which stay). Nothing is evicted."""
        if self.state_pool.num_free < 1:
            return False
        evictable = self.evictable_pages(keep=pinned) or {}
        return all(self.paged_pool(name).num_free + evictable.get(name, 0) >= 1 for name, _ in pinned.by_pool()
                   if self._last_page_partial(name, length))

    def fits_whole(self, seq, evictable: dict[str, int] | None) -> bool:
        """Whether `seq`, holding nothing, could be held at its whole length now (a decoding request's window pages:
        one window's), with `evictable` (evictable_pages()) counted free; nothing is allocated or evicted."""
        needs = self._page_needs(seq, seq.num_tokens)
        needs[0] = min(needs[0], self.window_pool.pages_per_running_request())  # (_pools[0] is the window pool)
        return self._fits(seq, needs, evictable)

    def can_extend_evicting(self, seq, num_new_tokens: int, evictable: dict[str, int] | None) -> bool:
        """can_extend, with `evictable` (evictable_pages()) counted free; nothing is evicted."""
        return self._fits(seq, self._page_needs(seq, num_new_tokens), evictable)

    def evict_cached_until(self, seq, num_new_tokens: int) -> bool:
        """Evict prefix-cache entries (least recently used first) until `seq`'s next `num_new_tokens` fit; whether they
        do. None is evicted where evicting every entry could not make them fit (the pages are running requests'):
        a head of the queue that waits for memory would otherwise empty the cache, step after step, for nothing."""
        if self.can_extend(seq, num_new_tokens):
            return True
        if self.prefix_cache is None or not self.can_extend_evicting(seq, num_new_tokens, self.evictable_pages()):
            return False
        while not self.can_extend(seq, num_new_tokens):
            if not self.prefix_cache.evict_one():
                return False
        return True

    def check(self) -> None:
        """free + used == total in every pool, and every page's references are exactly its holders: live
        requests and prefix-cache entries."""
        for pool in self._pools:
            cached = self.prefix_cache.held_pages(pool.name) if self.prefix_cache is not None else []
            pool.check([pages.runs[pool.name] for pages in self._live if pool.name in pages.runs], cached)
        self.state_pool.check(sum(pages.slot is not None for pages in self._live))
