"""Sliding-window K=V pool: `kv[layer, page, slot, head_dim]`, one page id shared by all layers.

A request holds the pages covering positions [max(0, next_pos - window + 1), computed end); a
forward over a chunk [s, s + n) also needs the window before s, so pages are released only after
the forward (`release_slid_out`). Logical page j of a request covers positions
[j * page_size, (j + 1) * page_size).
"""

from __future__ import annotations

from collections import deque

import torch

from backend.page_allocator import PageAllocator


class WindowPool:
    name = "window"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, head_dim: int, window: int,
                 dtype: torch.dtype, device: str | torch.device):
        self.page_size = page_size
        self.window = window
        self.allocator = PageAllocator(self.name, num_pages)
        self.kv = torch.zeros(num_layers, num_pages, page_size, head_dim, dtype=dtype, device=device)
        self._pages: dict[str, deque[tuple[int, int]]] = {}  # request -> (logical, physical), ascending

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def bytes_per_page(self) -> int:
        return self.kv[:, 0].numel() * self.kv.element_size()

    def _first_needed_page(self, start_pos: int) -> int:
        return max(0, start_pos - self.window + 1) // self.page_size

    def pages_needed(self, request_id: str, start_pos: int, num_new_tokens: int) -> int:
        """New pages a chunk [start_pos, start_pos + n) needs beyond those the request holds."""
        last = (start_pos + num_new_tokens - 1) // self.page_size
        held = self._pages.get(request_id)
        first = held[-1][0] + 1 if held else self._first_needed_page(start_pos)
        return max(0, last - first + 1)

    def extend(self, request_id: str, start_pos: int, num_new_tokens: int) -> None:
        n = self.pages_needed(request_id, start_pos, num_new_tokens)
        held = self._pages.setdefault(request_id, deque())
        first = held[-1][0] + 1 if held else self._first_needed_page(start_pos)
        for offset, page in enumerate(self.allocator.allocate(n)):
            held.append((first + offset, page))

    def release_slid_out(self, request_id: str, next_pos: int) -> None:
        """Free pages whose positions all lie before the window of the next token to compute."""
        held = self._pages.get(request_id)
        if not held:
            return
        first_needed = self._first_needed_page(next_pos)
        freed = []
        while held and held[0][0] < first_needed:
            freed.append(held.popleft()[1])
        self.allocator.free(freed)

    def free(self, request_id: str) -> None:
        held = self._pages.pop(request_id, None)
        if held:
            self.allocator.free([page for _, page in held])

    def block_row(self, request_id: str) -> tuple[int, list[int]]:
        """(first logical page, physical pages in logical order) of a request."""
        held = self._pages.get(request_id) or deque()
        return (held[0][0] if held else 0), [page for _, page in held]

    def pages_of(self, request_id: str) -> int:
        return len(self._pages.get(request_id, ()))

    def check(self) -> None:
        self.allocator.check()
        held = sum(len(pages) for pages in self._pages.values())
        assert held == self.allocator.num_used, f"window pool: requests hold {held}, allocator says {self.allocator.num_used}"
