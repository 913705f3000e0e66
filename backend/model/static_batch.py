"""Decode steps at static shapes, so that a CUDA graph captured once can replay every later step.

A CUDA graph fixes every tensor's shape and address. A decode step's shapes depend on the batch
size, on the context (block-table widths, the indexer's score width) and on how many compressor
windows close this step. Here a decode batch of B rows becomes a batch of `StaticKey`
shapes:
  rows      B padded to the bucket (1, 2, 4, 8, ...): padding rows decode token 0 at position 0 of
            the pools' scratch page / the state pool's scratch slot, which no request owns;
  context   the longest row's end rounded up to a power of two (at least 256): block tables are
            padded with the scratch page to its page count, the indexer scores it in full
            (entries past a token's causal ones are -inf and never picked);
  entries   a decode row closes at most one window per compressor, so every plan has exactly
            `rows` entries; the ones that do not close are padding (`entry_row` = -1, stored to the
            scratch page).
The padded step computes the same outputs for the real rows as the dynamic one
(tests/engine/test_static_batch.py checks it eagerly on CPU); `DecodeGraphs` in
backend/model/graph_runner.py keeps one set of static buffers (and, on CUDA, one graph) per key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from backend.memory.kv_manager import KVCacheManager
from backend.model.compressor import CompressionPlan, build_plan
from backend.model.forward_batch import BatchRow, ForwardBatch

MIN_CONTEXT_BUCKET = 256


@dataclass(frozen=True)
class StaticKey:
    rows: int
    context: int  # positions the block tables can address


def row_bucket(num_rows: int) -> int:
    return 1 << max(0, num_rows - 1).bit_length()


def context_bucket(max_end: int) -> int:
    return max(MIN_CONTEXT_BUCKET, 1 << max(0, max_end - 1).bit_length())


def static_key(rows: list[BatchRow]) -> StaticKey:
    return StaticKey(row_bucket(len(rows)), context_bucket(max(r.start_pos + len(r.token_ids) for r in rows)))


def is_decode_batch(rows: list[BatchRow]) -> bool:
    return bool(rows) and all(len(r.token_ids) == 1 and r.want_logits for r in rows)


def static_decode_batch(rows: list[BatchRow], kv: KVCacheManager, key: StaticKey, device) -> ForwardBatch:
    """The decode batch `rows` (one token each) padded to `key`'s shapes; logits for all key.rows rows."""
    assert (not rows or is_decode_batch(rows)) and len(rows) <= key.rows, \
        "a static batch holds up to key.rows decode rows (none: all padding)"
    page_size, window_pool = kv.page_size, kv.window_pool
    num_pad = key.rows - len(rows)
    ids = [r.token_ids[0] for r in rows] + [0] * num_pad
    positions = [r.start_pos for r in rows] + [0] * num_pad
    slots = [r.pages.slot for r in rows] + [kv.state_pool.scratch_slot] * num_pad

    window_width = window_pool.pages_per_running_request()
    window_rows, first_pages, write_index = [], [], []
    for r in rows:
        first, pages = kv.window_row(r.pages)
        window_rows.append(_pad(pages, window_width, window_pool.scratch_page))
        first_pages.append(first)
        write_index.append(pages[r.start_pos // page_size - first] * page_size + r.start_pos % page_size)
    for _ in range(num_pad):
        window_rows.append([window_pool.scratch_page] * window_width)
        first_pages.append(0)
        write_index.append(window_pool.scratch_page * page_size)

    comp_tables, max_entries = {}, {}
    for name, pool in kv.compressed_pools.items():
        entries = key.context // pool.compress_rate
        width = max(1, -(-entries // page_size))
        table = [_pad(kv.compressed_row(r.pages, name), width, pool.scratch_page) for r in rows]
        table += [[pool.scratch_page] * width] * num_pad
        comp_tables[name] = torch.tensor(table, dtype=torch.int32, device=device)
        max_entries[name] = entries

    ones, offsets = [1] * key.rows, list(range(key.rows))
    plans = {}
    if kv.has_pool("csa"):
        plans["csa"] = plans["indexer"] = _padded_plan(build_plan(kv.model.csa_rate, True, positions, ones, offsets,
                                                                  slots, device), key.rows)
    if kv.has_pool("hca"):
        plans["hca"] = _padded_plan(build_plan(kv.model.hca_rate, False, positions, ones, offsets, slots, device),
                                    key.rows)

    def long(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    return ForwardBatch(
        input_ids=long(ids), positions=long(positions), token_seq=long(range(key.rows)),
        logits_token_index=long(range(key.rows)), window_write_index=long(write_index),
        window_block_table=torch.tensor(window_rows, dtype=torch.int32, device=device),
        window_first_page=long(first_pages), comp_block_tables=comp_tables, plans=plans, max_entries=max_entries,
    )


def _pad(pages: list[int], width: int, scratch: int) -> list[int]:
    assert len(pages) <= width, f"{len(pages)} pages do not fit a static row of {width}"
    return list(pages) + [scratch] * (width - len(pages))


def _padded_plan(plan: CompressionPlan, num_entries: int) -> CompressionPlan:
    """`plan` with exactly num_entries entries: the missing ones are padding (entry_row -1), computed from
    source 0 (finite values) and stored to the scratch page."""
    missing = num_entries - plan.num_entries
    assert missing >= 0, "a decode step closes at most one window per row"

    def pad(t: torch.Tensor, value) -> torch.Tensor:
        return torch.cat([t, torch.full((missing, *t.shape[1:]), value, dtype=t.dtype, device=t.device)])

    return CompressionPlan(
        rate=plan.rate, overlap=plan.overlap, ring=plan.ring, ring_slots=plan.ring_slots, ring_order=plan.ring_order,
        entry_src=pad(plan.entry_src, 0), entry_valid=pad(plan.entry_valid, True), entry_pos=pad(plan.entry_pos, 0),
        entry_row=pad(plan.entry_row, -1), entry_index=pad(plan.entry_index, 0),
        keep_src=plan.keep_src, keep_slot=plan.keep_slot, keep_pos=plan.keep_pos,
        num_snapshot_keep=plan.num_snapshot_keep,
    )


def copy_batch(dst: ForwardBatch, src: ForwardBatch) -> None:
    """Copy every tensor of `src` into the same-shaped tensors of `dst` (a plan shared by two streams once)."""
    done: set[int] = set()

    def copy(d: torch.Tensor, s: torch.Tensor, name: str) -> None:
        if id(d) in done:
            return
        assert d.shape == s.shape and d.dtype == s.dtype, f"{name}: {tuple(s.shape)} does not fit {tuple(d.shape)}"
        d.copy_(s, non_blocking=True)
        done.add(id(d))

    for f in fields(dst):
        d, s = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(d, torch.Tensor):
            copy(d, s, f.name)
        elif f.name == "comp_block_tables":
            for k in d:
                copy(d[k], s[k], f"{f.name}[{k}]")
        elif f.name == "plans":
            for k in d:
                for pf in fields(d[k]):
                    if isinstance(getattr(d[k], pf.name), torch.Tensor):
                        copy(getattr(d[k], pf.name), getattr(s[k], pf.name), f"plans[{k}].{pf.name}")
        else:
            assert d == s, f"{f.name} differs between static batches of one key"
