"""All of a deployment's paged memory, behind the interface the scheduler and the model use.

Sizing (EngineConfig): `num_tokens` positions across all requests for the compressed pools
(num_tokens / 4 CSA entries, num_tokens / 128 HCA entries), plus one page per pool for each of
`max_running_requests` (a request's last page is partly empty: with 64-entry pages one HCA page
covers 8192 positions, and 32 short requests would otherwise need 32 pages of a pool sized for a
few), `num_tokens * swa_full_tokens_ratio` positions for the sliding-window pool, `page_size` slots
per page, and one compressor-state slot per running request. "Tokens" always mean positions in
the full sequence.

Ownership: a request's pages and its compressor-state slot live in its `RequestPages` handle
(`seq.pages`), created by the first `extend` and emptied by `free` (preemption, the end of the
request). The scheduler decides when; this module only does the arithmetic and the bookkeeping.
The model reads the tensors of one layer through `layer(i)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.memory.compressed_pool import CompressedPool
from backend.memory.compressor_state import CompressorStatePool
from backend.memory.page_allocator import OutOfPages
from backend.memory.paged_pool import PagedPool, PageRun
from backend.memory.window_pool import WindowPool
from backend.model.config import CSA, HCA, ModelConfig


@dataclass(eq=False)
class RequestPages:
    """One request's memory: a page run per paged pool and its compressor-state slot."""

    owner: "KVCacheManager"
    runs: dict[str, PageRun] = field(default_factory=dict)
    slot: int | None = None

    def run(self, pool: str) -> PageRun:
        return self.runs.setdefault(pool, PageRun())

    def release(self) -> None:
        """Every page and the slot back to their pools (idempotent)."""
        self.owner.release(self)


@dataclass
class LayerMemory:
    """The tensors one layer reads and writes (views into the pools; None where the layer has none).

    window_kv [pages, page_size, Dh]; compressed_kv [pages, page_size, Dh] and index_k
    [pages, page_size, Di] for CSA, compressed_kv for HCA; `pool` names the compressed pool;
    `state[stream] = (kv ring, gate ring)`, each [slots, ring, width], for the layer's compressors.
    """

    window_kv: torch.Tensor
    pool: str | None = None
    compress_rate: int = 0
    compressed_kv: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    state: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _pages(entries: int, page_size: int, partial_pages: int) -> int:
    """Pages for `entries` entries plus one partly filled page per running request."""
    return -(-entries // page_size) + partial_pages


class KVCacheManager:
    def __init__(self, model: ModelConfig, *, num_tokens: int, swa_full_tokens_ratio: float, page_size: int,
                 max_running_requests: int, dtype: torch.dtype, device: str | torch.device):
        self.model = model
        self.page_size = page_size
        self.window = model.sliding_window
        csa_layers, hca_layers = len(model.layers_of_type(CSA)), len(model.layers_of_type(HCA))
        window_pages = max(1, int(num_tokens * swa_full_tokens_ratio) // page_size)
        self.window_pool = WindowPool(model.num_hidden_layers, window_pages, page_size, model.head_dim,
                                      model.sliding_window, dtype, device)
        self.compressed_pools: dict[str, CompressedPool] = {}
        if csa_layers:
            self.compressed_pools["csa"] = CompressedPool(
                "csa", model.csa_rate, csa_layers, _pages(num_tokens // model.csa_rate, page_size, max_running_requests),
                page_size, {"kv": model.head_dim, "index_k": model.index_head_dim}, dtype, device)
        if hca_layers:
            self.compressed_pools["hca"] = CompressedPool(
                "hca", model.hca_rate, hca_layers, _pages(num_tokens // model.hca_rate, page_size, max_running_requests),
                page_size, {"kv": model.head_dim}, dtype, device)
        self._state_rings = {
            "csa": (csa_layers, 2 * model.csa_rate, 2 * model.head_dim),
            "indexer": (csa_layers, 2 * model.csa_rate, 2 * model.index_head_dim),
            "hca": (hca_layers, model.hca_rate, model.head_dim),
        }
        self.state_pool = CompressorStatePool(max_running_requests, self._state_rings, dtype, device)
        self._layers = [self._layer_memory(i) for i in range(model.num_hidden_layers)]
        self._live: set[RequestPages] = set()  # handles holding anything, for check()
        self.prefix_cache = None  # backend/memory/prefix_cache.py, when enabled

    def enable_prefix_caching(self, block_tokens: int, max_entries: int, max_end_entries: int | None = None) -> None:
        """Before any request: the state pool gets `max_entries` spare slots, where the cache keeps its ring
        snapshots: `max_end_entries` (default: all) full ones, which a request's end needs, and light ones holding
        only the rings a continuation from a block boundary reads."""
        from backend.memory.prefix_cache import PrefixCache

        assert not self._live and self.prefix_cache is None, "enable prefix caching before serving"
        max_end_entries = max_entries if max_end_entries is None else max_end_entries
        assert 0 <= max_end_entries <= max_entries, (max_end_entries, max_entries)
        old = self.state_pool
        self.state_pool = CompressorStatePool(old.allocator.num_pages, self._state_rings, old.dtype, old.device,
                                              num_spare=max_end_entries, num_light_spare=max_entries - max_end_entries,
                                              light_streams=self._streams_read_at(block_tokens))
        self._layers = [self._layer_memory(i) for i in range(self.model.num_hidden_layers)]
        self.prefix_cache = PrefixCache(self, block_tokens, max_entries)

    def _streams_read_at(self, block_tokens: int) -> frozenset[str]:
        """The compressor streams whose rings a continuation from a multiple of `block_tokens` reads: CSA and its
        indexer (overlapping windows: the last closed window), HCA only if its windows do not close there."""
        streams = {"csa", "indexer"}
        if block_tokens % self.model.hca_rate:
            streams.add("hca")
        return frozenset(streams)

    def track(self, pages: RequestPages) -> None:
        """A handle given memory outside `extend` (a restored prefix) is accounted for like the others."""
        self._live.add(pages)

    def _paged_pools(self) -> list[PagedPool]:
        return [self.window_pool, *self.compressed_pools.values()]

    # --- the model's interface ---------------------------------------------------------------------
    def _layer_memory(self, i: int) -> LayerMemory:
        layer_type = self.model.layer_types[i]
        memory = LayerMemory(window_kv=self.window_pool.kv[i])
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

    def window_row(self, pages: RequestPages) -> tuple[int, list[int]]:
        """(first logical page, physical pages in logical order) of a request's window."""
        run = pages.run("window")
        return run.first, list(run.pages)

    def compressed_row(self, pages: RequestPages, pool: str) -> list[int]:
        return list(pages.run(pool).pages)

    # --- the scheduler's interface -------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return self.state_pool.num_free > 0

    def _page_needs(self, seq, num_new_tokens: int):
        start, pages = seq.num_computed_tokens, seq.pages
        for pool in self._paged_pools():
            run = pages.runs.get(pool.name) if pages is not None else None
            yield pool, pool.pages_needed(run, start, num_new_tokens)

    def can_extend(self, seq, num_new_tokens: int) -> bool:
        has_slot = seq.pages is not None and seq.pages.slot is not None
        if not has_slot and self.state_pool.num_free == 0:
            return False
        return all(need <= pool.num_free for pool, need in self._page_needs(seq, num_new_tokens))

    def extend(self, seq, num_new_tokens: int) -> None:
        """Allocate pages for tokens [num_computed, num_computed + n); all or nothing."""
        if not self.can_extend(seq, num_new_tokens):
            short = [(p.name, need, p.num_free) for p, need in self._page_needs(seq, num_new_tokens)
                     if need > p.num_free]
            raise OutOfPages(*(short[0] if short else ("compressor_state", 1, 0)))
        if seq.pages is None:
            seq.pages = RequestPages(self)
        pages = seq.pages
        if pages.slot is None:
            pages.slot = self.state_pool.acquire()
        self._live.add(pages)
        for pool in self._paged_pools():
            pool.extend(pages.run(pool.name), seq.num_computed_tokens, num_new_tokens)

    def release_slid_out(self, seq) -> None:
        """After a forward: drop window pages that no later token can attend to."""
        if seq.pages is not None:
            self.window_pool.release_slid_out(seq.pages.run("window"), seq.num_computed_tokens)

    def free(self, seq) -> None:
        """Return every page and the slot of `seq` (idempotent)."""
        seq.release_pages()

    def release(self, pages: RequestPages) -> None:
        for pool in self._paged_pools():
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
        return min(limits + [self.model.max_position_embeddings])

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
                for pool in self._paged_pools()}
        held[self.state_pool.name] = sum(pages.slot is not None for pages in self._live)
        return held

    def _page_counts(self) -> dict[str, tuple[int, int]]:
        allocators = [p.allocator for p in self._paged_pools()] + [self.state_pool.allocator]
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

    def evict_cached_until(self, fits) -> bool:
        """Evict prefix-cache entries (least recently used first) until `fits()`; its final answer."""
        while not fits():
            if self.prefix_cache is None or not self.prefix_cache.evict_one():
                return False
        return True

    def check(self) -> None:
        """free + used == total in every pool, and every page's references are exactly its holders: live
        requests and prefix-cache entries."""
        for pool in self._paged_pools():
            cached = self.prefix_cache.held_pages(pool.name) if self.prefix_cache is not None else []
            pool.check([pages.runs[pool.name] for pages in self._live if pool.name in pages.runs], cached)
        self.state_pool.check(sum(pages.slot is not None for pages in self._live))
