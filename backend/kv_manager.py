"""All of a deployment's paged memory, behind the interface the scheduler uses.

Sizing (EngineConfig): `num_tokens` positions across all requests for the compressed pools
(num_tokens / 4 CSA entries, num_tokens / 128 HCA entries), plus one page per pool for each of
`max_running_requests` (a request's last page is partly empty: with 64-entry pages one HCA page
covers 8192 positions, and 32 short requests would otherwise need 32 pages of a pool sized for a
few), `num_tokens * swa_full_tokens_ratio` positions for the sliding-window pool, `page_size` slots
per page, and one compressor-state slot per running request. "Tokens" always mean positions in
the full sequence.
"""

from __future__ import annotations

import torch

from backend.model_config import CSA, HCA, ModelConfig
from backend.page_allocator import OutOfPages
from backend.pools.compressed_pool import CompressedPool
from backend.pools.compressor_state import CompressorStatePool
from backend.pools.window_pool import WindowPool


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
        self.compressed_pools: list[CompressedPool] = []
        if csa_layers:
            self.csa_pool = CompressedPool(
                "csa", model.csa_rate, csa_layers, _pages(num_tokens // model.csa_rate, page_size, max_running_requests),
                page_size,
                {"kv": model.head_dim, "index_k": model.index_head_dim}, dtype, device)
            self.compressed_pools.append(self.csa_pool)
        if hca_layers:
            self.hca_pool = CompressedPool(
                "hca", model.hca_rate, hca_layers, _pages(num_tokens // model.hca_rate, page_size, max_running_requests),
                page_size,
                {"kv": model.head_dim}, dtype, device)
            self.compressed_pools.append(self.hca_pool)
        self.state_pool = CompressorStatePool(max_running_requests, {
            "csa": (csa_layers, 2 * model.csa_rate, 2 * model.head_dim),
            "indexer": (csa_layers, 2 * model.csa_rate, 2 * model.index_head_dim),
            "hca": (hca_layers, model.hca_rate, model.head_dim),
        }, dtype, device)

    # --- the scheduler's interface -------------------------------------------------------------
    def has_free_slot(self) -> bool:
        return self.state_pool.num_free > 0

    def _page_needs(self, seq, num_new_tokens: int):
        start = seq.num_computed_tokens
        yield self.window_pool, self.window_pool.pages_needed(seq.request_id, start, num_new_tokens)
        for pool in self.compressed_pools:
            yield pool, pool.pages_needed(seq.request_id, start, num_new_tokens)

    def can_extend(self, seq, num_new_tokens: int) -> bool:
        if not self.state_pool.has(seq.request_id) and self.state_pool.num_free == 0:
            return False
        return all(need <= pool.allocator.num_free for pool, need in self._page_needs(seq, num_new_tokens))

    def extend(self, seq, num_new_tokens: int) -> None:
        """Allocate pages for tokens [num_computed, num_computed + n); all or nothing."""
        if not self.can_extend(seq, num_new_tokens):
            short = [(p.allocator.name, need, p.allocator.num_free)
                     for p, need in self._page_needs(seq, num_new_tokens) if need > p.allocator.num_free]
            name, need, free = short[0] if short else ("compressor_state", 1, 0)
            raise OutOfPages(name, need, free)
        self.state_pool.acquire(seq.request_id)
        start = seq.num_computed_tokens
        self.window_pool.extend(seq.request_id, start, num_new_tokens)
        for pool in self.compressed_pools:
            pool.extend(seq.request_id, start, num_new_tokens)

    def release_slid_out(self, seq) -> None:
        """After a forward: drop window pages that no later token can attend to."""
        self.window_pool.release_slid_out(seq.request_id, seq.num_computed_tokens)

    def free(self, seq) -> None:
        self.window_pool.free(seq.request_id)
        for pool in self.compressed_pools:
            pool.free(seq.request_id)
        self.state_pool.free(seq.request_id)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Could one request of this many positions run in an otherwise empty engine?"""
        min_window_pages = -(-self.window // self.page_size) + 1  # one-token chunks: the window plus one page
        if min_window_pages > self.window_pool.num_pages:
            return False
        return all(pool.pages_for_tokens(num_tokens) <= pool.num_pages for pool in self.compressed_pools)

    def max_request_tokens(self) -> int:
        """The longest request (prompt + output positions) the compressed pools can hold alone."""
        limits = [pool.num_pages * self.page_size * pool.compress_rate + pool.compress_rate - 1
                  for pool in self.compressed_pools]
        return min(limits + [self.model.max_position_embeddings])

    def window_pages_per_running_request(self) -> int:
        """Pages a decoding request holds at most: its window may straddle one more page."""
        return -(-self.window // self.page_size) + 1

    def derived_prefill_chunk_tokens(self, max_running_requests: int) -> int:
        """Chunk budget from the window pool, as in the seed bug report's engine.

        free = window pages - max_running_requests * pages_per_running_request; the chunk gets the
        free pages, less the pages its own window (the `window` positions before it) occupies:
            chunk = (free - ceil(window / page_size)) * page_size, at least one page.
        """
        free = self.window_pool.num_pages - max_running_requests * self.window_pages_per_running_request()
        chunk_pages = free - -(-self.window // self.page_size)
        return max(self.page_size, chunk_pages * self.page_size)

    def usage(self) -> dict[str, float]:
        out = {p.allocator.name: p.allocator.num_used / p.allocator.num_pages for p in self._allocating_pools()}
        out["compressor_state"] = self.state_pool.allocator.num_used / self.state_pool.allocator.num_pages
        return out

    def pages_used(self) -> dict[str, int]:
        out = {p.allocator.name: p.allocator.num_used for p in self._allocating_pools()}
        out["compressor_state"] = self.state_pool.allocator.num_used
        return out

    # --- capacity report -----------------------------------------------------------------------
    def _allocating_pools(self):
        return [self.window_pool, *self.compressed_pools]

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one sequence position costs in each pool (compressed pools amortise over their rate)."""
        out = {"window": self.window_pool.bytes_per_page() / self.page_size}
        for pool in self.compressed_pools:
            out[pool.name] = pool.bytes_per_page() / (self.page_size * pool.compress_rate)
        return out

    def capacity(self) -> dict[str, int]:
        """Positions each pool can hold across all requests."""
        out = {"window": self.window_pool.num_pages * self.page_size}
        for pool in self.compressed_pools:
            out[pool.name] = pool.num_pages * self.page_size * pool.compress_rate
        out["running_requests"] = self.state_pool.allocator.num_pages
        return out

    def check(self) -> None:
        """free + used == total in every pool, and every request's pages accounted for."""
        self.window_pool.check()
        for pool in self.compressed_pools:
            pool.check()
        self.state_pool.check()


def _pages(entries: int, page_size: int, partial_pages: int) -> int:
    """Pages for `entries` entries plus one partly filled page per running request."""
    return -(-entries // page_size) + partial_pages
