"""The shared base of the paged pools: an allocator, the page tensors, and one rule for page spans.

A request holds, in each paged pool, a `PageRun`: consecutive logical pages starting at `first`,
backed by the physical pages in `pages` (one per logical page, in order). Subclasses say only
which logical pages a request needs after computing positions [0, end) (`needed_span`); growing,
sliding and freeing a run are the same for every pool. Runs live in the request's `RequestPages`
handle (backend/memory/kv_manager.py), not in the pool, so releasing a request is one call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from backend.memory.page_allocator import PageAllocator


@dataclass
class PageRun:
    """Logical pages [first, first + len(pages)) of one request in one pool."""

    first: int = 0
    pages: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + len(self.pages)


class PagedPool:
    """`tensors[stream][layer, page, slot, width]`; one page id covers every layer and stream."""

    name: str

    def __init__(self, name: str, num_layers: int, num_pages: int, page_size: int, widths: dict[str, int],
                 dtype: torch.dtype, device: str | torch.device):
        self.name = name
        self.page_size = page_size
        self.num_layers = num_layers
        self.allocator = PageAllocator(name, num_pages)
        # One page past the allocator's: the padding rows of static-shape (CUDA graph) steps write there.
        self.scratch_page = num_pages
        self.tensors = {stream: torch.zeros(num_layers, num_pages + 1, page_size, width, dtype=dtype, device=device)
                        for stream, width in widths.items()}

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def bytes_per_page(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.tensors.values())

    def needed_span(self, start_pos: int, end_pos: int) -> tuple[int, int]:
        """Logical pages [lo, hi) a forward over positions [start_pos, end_pos) needs."""
        raise NotImplementedError

    def pages_needed(self, run: PageRun | None, start_pos: int, num_new_tokens: int) -> int:
        """New pages a chunk [start_pos, start_pos + n) needs beyond those `run` holds."""
        lo, hi = self.needed_span(start_pos, start_pos + num_new_tokens)
        first_missing = run.first + len(run.pages) if run is not None and run.pages else lo
        return max(0, hi - first_missing)

    def extend(self, run: PageRun, start_pos: int, num_new_tokens: int) -> None:
        """Allocate the missing pages of the chunk into `run` (all or nothing: raises OutOfPages)."""
        needed = self.pages_needed(run, start_pos, num_new_tokens)
        if not run.pages:
            run.first = self.needed_span(start_pos, start_pos + num_new_tokens)[0]
        run.pages.extend(self.allocator.allocate(needed))

    def release_before(self, run: PageRun, logical_page: int) -> None:
        """Free the run's pages below `logical_page` (positions no later token reads)."""
        drop = max(0, min(logical_page, run.end) - run.first)
        if drop:
            self.allocator.free(run.pages[:drop])
            run.first, run.pages = run.first + drop, run.pages[drop:]

    def free(self, run: PageRun) -> None:
        self.allocator.free(run.pages)
        run.first, run.pages = 0, []

    def check(self, runs: list[PageRun], cached: list[list[int]] = ()) -> None:
        """free + used == total, and each used page has exactly as many references as holders: the runs of
        live requests and the `cached` page lists (prefix-cache entries)."""
        self.allocator.check()
        holders = Counter(page for run in runs for page in run.pages)
        holders.update(page for pages in cached for page in pages)
        references = {page: self.allocator.refs(page) for page in holders}
        assert dict(holders) == references and len(holders) == self.allocator.num_used, \
            f"{self.name} pool: holders {dict(holders)} do not match the references {references} " \
            f"({self.allocator.num_used} pages used)"
