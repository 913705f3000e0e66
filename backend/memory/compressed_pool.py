"""Compressed-entry pool for one kind of compressed layer (CSA or HCA).

`tensors[name][layer, page, slot, width]` for each stored stream (CSA: the compressed K=V entries
and the indexer keys; HCA: the entries). Entry e of a request lives in its logical page
e // page_size. A request that has computed n tokens holds n // compress_rate entries; pages are
kept until the request ends (every past entry stays attendable).
"""

from __future__ import annotations

import torch

from backend.memory.paged_pool import PagedPool


class CompressedPool(PagedPool):
    def __init__(self, name: str, compress_rate: int, num_layers: int, num_pages: int, page_size: int,
                 widths: dict[str, int], dtype: torch.dtype, device: str | torch.device):
        super().__init__(name, num_layers, num_pages, page_size, widths, dtype, device)
        self.compress_rate = compress_rate

    def pages_for_tokens(self, num_tokens):
        """Pages holding the entries of `num_tokens` positions (an int, or a tensor of them: a batch's rows)."""
        entries = num_tokens // self.compress_rate
        return -(-entries // self.page_size)

    def needed_span(self, start_pos: int, end_pos: int) -> tuple[int, int]:
        return 0, self.pages_for_tokens(end_pos)

    def positions_held(self) -> int:
        """Positions the whole pool covers across all requests."""
        return self.num_pages * self.page_size * self.compress_rate
