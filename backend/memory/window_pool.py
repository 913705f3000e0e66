"""Sliding-window K=V pool: `kv[layer, page, slot, head_dim]`, one page id shared by all layers.

A request holds the pages covering positions [max(0, next_pos - window + 1), computed end); a
forward over a chunk [s, s + n) also needs the window before s, so pages are released only after
the forward (`release_slid_out`). Logical page j of a request covers positions
[j * page_size, (j + 1) * page_size).
"""

from __future__ import annotations

import torch

from backend.memory.paged_pool import PagedPool, PageRun


class WindowPool(PagedPool):
    def __init__(self, num_layers: int, num_pages: int, page_size: int, head_dim: int, window: int,
                 dtype: torch.dtype, device: str | torch.device, decode_lookahead: int = 0):
        """`decode_lookahead`: positions a decoding request holds beyond its next one (speculative decoding: the
        draft tokens a verify step computes and the positions the draft layer's chain writes)."""
        super().__init__("window", num_layers, num_pages, page_size, {"kv": head_dim}, dtype, device)
        self.window = window
        self.decode_lookahead = decode_lookahead

    @property
    def kv(self) -> torch.Tensor:
        return self.tensors["kv"]

    def first_needed_page(self, next_pos: int) -> int:
        """The first page the window of position `next_pos` reads."""
        return max(0, next_pos - self.window + 1) // self.page_size

    def needed_span(self, start_pos: int, end_pos: int) -> tuple[int, int]:
        return self.first_needed_page(start_pos), -(-end_pos // self.page_size)

    def release_slid_out(self, run: PageRun, next_pos: int) -> None:
        """Free pages whose positions all lie before the window of the next token to compute."""
        first = max(0, next_pos - self.window + 1) // self.page_size
        if first > run.first:  # (at most steps, nothing slid out)
            self.release_before(run, first)

    def pages_per_running_request(self) -> int:
        """Pages a decoding request holds at most: its window (and lookahead) may straddle one more page."""
        return -(-(self.window + self.decode_lookahead) // self.page_size) + 1
