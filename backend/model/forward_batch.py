"""The metadata of one forward over a ragged batch: which tokens, where their memory is.

A batch is a list of rows, one per request: tokens [start, start + n) of that request (n = 1 for a
decode, a chunk for a prefill). Tokens are laid out row after row. Pages for every row must have
been allocated (`KVCacheManager.extend`) before the batch is built.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from backend.memory.kv_manager import KVCacheManager, RequestPages
from backend.model.compressor import CompressionPlan, build_plan


@dataclass
class BatchRow:
    pages: RequestPages  # the request's memory (allocated for these tokens)
    token_ids: list[int]  # the row's tokens to compute
    start_pos: int
    want_logits: bool  # the chunk reaches the end of the sequence: sample a token
    # (position P, spare state slot): keep the compressor rings as they stand at P, inside this chunk, in that
    # slot (prefix caching, backend/memory/prefix_cache.py)
    snapshots: tuple[tuple[int, int], ...] = ()


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    token_seq: torch.Tensor  # [T] long, the row of each token
    logits_token_index: torch.Tensor  # [R] long, tokens whose logits the forward returns
    window_write_index: torch.Tensor  # [T] long, page * page_size + slot in the window pool
    window_block_table: torch.Tensor  # [B, W] int32
    window_first_page: torch.Tensor  # [B] long
    comp_block_tables: dict[str, torch.Tensor]  # pool name -> [B, C] int32
    plans: dict[str, CompressionPlan]  # "csa", "indexer" and "hca"
    # pool name -> the most entries any token of the batch may attend to (host int: the indexer's score
    # width, so that no kernel wrapper reads positions back from the device)
    max_entries: dict[str, int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device) -> "ForwardBatch":
        """A copy with every tensor on `device` (a plan shared by two streams stays shared)."""
        moved: dict[int, object] = {}

        def move(value):
            if id(value) in moved:
                return moved[id(value)]
            if isinstance(value, torch.Tensor):
                out = value.to(device, copy=True)
            elif isinstance(value, dict):
                out = {k: move(v) for k, v in value.items()}
            elif hasattr(value, "__dataclass_fields__"):
                out = replace(value, **{f.name: move(getattr(value, f.name)) for f in fields(value)})
            else:
                out = value
            moved[id(value)] = out
            return out

        return move(self)


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    """Rows of page ids padded with page 0 (never read: the kernels mask by position)."""
    width = max(1, max((len(r) for r in rows), default=1))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


def build_forward_batch(rows: list[BatchRow], kv: KVCacheManager, device) -> ForwardBatch:
    ids, positions, token_seq, logits_index, write_index = [], [], [], [], []
    window_rows, first_pages = [], []
    starts, lens, offsets, slots, snapshots = [], [], [], [], []
    page_size = kv.page_size
    for b, row in enumerate(rows):
        n = len(row.token_ids)
        offset = len(ids)
        ids.extend(row.token_ids)
        pos = list(range(row.start_pos, row.start_pos + n))
        positions.extend(pos)
        token_seq.extend([b] * n)
        if row.want_logits:
            logits_index.append(offset + n - 1)
        first, pages = kv.window_row(row.pages)
        window_rows.append(pages)
        first_pages.append(first)
        write_index.extend(pages[p // page_size - first] * page_size + p % page_size for p in pos)
        starts.append(row.start_pos)
        lens.append(n)
        offsets.append(offset)
        slots.append(row.pages.slot)
        snapshots.extend((b, position, slot) for position, slot in row.snapshots)

    model = kv.model
    plans = {}
    if kv.has_pool("csa"):
        plans["csa"] = build_plan(model.csa_rate, True, starts, lens, offsets, slots, device, snapshots)
        plans["indexer"] = plans["csa"]
    if kv.has_pool("hca"):
        plans["hca"] = build_plan(model.hca_rate, False, starts, lens, offsets, slots, device, snapshots)

    def long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=long(ids),
        positions=long(positions),
        token_seq=long(token_seq),
        logits_token_index=long(logits_index),
        window_write_index=long(write_index),
        window_block_table=_padded(window_rows, device),
        window_first_page=long(first_pages),
        comp_block_tables={name: _padded([kv.compressed_row(r.pages, name) for r in rows], device)
                           for name in kv.compressed_pools},
        plans=plans,
        max_entries={name: max((s + n) // pool.compress_rate for s, n in zip(starts, lens)) if rows else 0
                     for name, pool in kv.compressed_pools.items()},
    )
