"""Compressed-entry pool for one kind of compressed layer (CSA or HCA).

`tensors[name][layer, page, slot, width]` for each stored stream (CSA: the compressed K=V entries
and the indexer keys; HCA: the entries). Entry e of a request lives in its logical page
e // page_size. A request that has computed n tokens holds n // compress_rate entries; pages are
kept until the request ends (every past entry stays attendable).
"""

from __future__ import annotations

import torch

from backend.page_allocator import PageAllocator


class CompressedPool:
    def __init__(self, name: str, compress_rate: int, num_layers: int, num_pages: int, page_size: int,
                 widths: dict[str, int], dtype: torch.dtype, device: str | torch.device):
        self.name = name
        self.compress_rate = compress_rate
        self.page_size = page_size
        self.num_layers = num_layers
        self.allocator = PageAllocator(name, num_pages)
        self.tensors = {
            stream: torch.zeros(num_layers, num_pages, page_size, width, dtype=dtype, device=device)
            for stream, width in widths.items()
        }
        self._pages: dict[str, list[int]] = {}

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def bytes_per_page(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.tensors.values())

    def pages_for_tokens(self, num_tokens: int) -> int:
        entries = num_tokens // self.compress_rate
        return -(-entries // self.page_size)

    def pages_needed(self, request_id: str, start_pos: int, num_new_tokens: int) -> int:
        return max(0, self.pages_for_tokens(start_pos + num_new_tokens) - len(self._pages.get(request_id, ())))

    def extend(self, request_id: str, start_pos: int, num_new_tokens: int) -> None:
        n = self.pages_needed(request_id, start_pos, num_new_tokens)
        self._pages.setdefault(request_id, []).extend(self.allocator.allocate(n))

    def free(self, request_id: str) -> None:
        pages = self._pages.pop(request_id, None)
        if pages:
            self.allocator.free(pages)

    def block_row(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    def pages_of(self, request_id: str) -> int:
        return len(self._pages.get(request_id, ()))

    def check(self) -> None:
        self.allocator.check()
        held = sum(len(pages) for pages in self._pages.values())
        assert held == self.allocator.num_used, f"{self.name} pool: requests hold {held}, allocator says {self.allocator.num_used}"
