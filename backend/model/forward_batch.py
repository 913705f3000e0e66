"""The metadata of one forward over a ragged batch: which tokens, where their memory is.

A batch is a list of rows, one per request: tokens [start, start + n) of that request (n = 1 for a
decode, a chunk for a prefill). Tokens are laid out row after row. Pages for every row must have
been allocated (`KVCacheManager.try_extend`) before the batch is built.

`build_forward_batch` is the one builder: it walks the rows once (a few appends per row; nothing that
grows with a request's context: block tables are gathered from the memory manager's persistent
tables), and with `pad_to` it pads the batch to a static shape for CUDA graphs
(backend/model/static_batch.py says what padding rows are). The batch is built on the host; the
executor moves it to the device in one copy (backend/model/staging.py).

A decode row's token may still be on the device: sampled by the step before, whose output the host
has not seen (overlap scheduling); so may a verify row's tokens, the token after the verify before it and that
one's drafts (overlapped verify steps). Such a row says so (`from_previous_step`), and the batch's `token_source`
tells the executor to read its tokens from the runner's last-token buffer (1 + k tokens a request, by its state
slot) before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from backend.model.compressor import CompressionPlan, build_plan, build_uniform_plan
from backend.model.staging import map_leaves
from backend.model.static_batch import StaticKey, entries_per_row, snapshot_keep_per_row

if TYPE_CHECKING:  # the pools are handed in, never made here
    from backend.memory.kv_manager import KVCacheManager, RequestPages


@dataclass(slots=True)
class BatchRow:
    pages: RequestPages  # the request's memory (allocated for these tokens)
    token_ids: list[int]  # the row's tokens to compute (a from_previous_step row's: stand-ins)
    start_pos: int
    want_logits: bool  # the chunk reaches the end of the sequence: sample a token
    # (position P, spare state slot): keep the compressor rings as they stand at P, in (start, end], in that slot
    # (prefix caching, backend/memory/prefix_cache.py)
    snapshots: tuple[tuple[int, int], ...] = ()
    from_previous_step: bool = False  # its tokens are the ones the step in flight left for this request
    num_logits: int = 1  # with want_logits, the row's last tokens that want logits (a verify: all of them)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    token_seq: torch.Tensor  # [T] long, the row of each token
    token_source: torch.Tensor  # [T] long: -1, or where in the runner's last-token buffer this token's id is
    logits_token_index: torch.Tensor  # [R] long, tokens whose logits the forward returns
    logits_slot: torch.Tensor  # [R] long, the state slot of each logits row (where its sampled token is kept)
    window_write_index: torch.Tensor  # [T] long, page * page_size + slot in the window pool
    window_block_table: torch.Tensor  # [B, W] int32
    window_first_page: torch.Tensor  # [B] long
    comp_block_tables: dict[str, torch.Tensor]  # pool name -> [B, C] int32
    plans: dict[str, CompressionPlan]  # "csa", "indexer" and "hca"
    # pool name -> the most entries any token of the batch may attend to (host int: the indexer's score
    # width, so that no kernel wrapper reads positions back from the device)
    max_entries: dict[str, int]
    # data-parallel attention (backend/model/parallel_layout.py): every rank's token count this step, in rank order
    # (host ints: the MoE exchange pads to the largest without reading sizes back); () on a single rank
    dp_token_counts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device) -> "ForwardBatch":
        """A copy with every tensor on `device` (a plan shared by two streams stays shared)."""
        return map_leaves(self, lambda t: t.to(device, copy=True))


def build_forward_batch(rows: list[BatchRow], kv: KVCacheManager, device="cpu",
                        pad_to: StaticKey | None = None, compressed: bool = True) -> ForwardBatch:
    """The batch of `rows`, built on the host (then moved to `device` if that is not the host); with `pad_to`, padded
    to that static shape (decode rows only): logits for every row, padding rows included. `compressed` False: the
    window's metadata only, no compressed block tables or compression plans (the draft layer's passes: a
    sliding-window block).

    The rows are read once, a few fields each; everything else is array arithmetic over them, in numpy (a step's
    batch is a few values per row: numpy's operations on them cost a fraction of torch's, and the arrays become the
    batch's tensors without a copy). A row's page runs are not walked: its window spans the logical pages from its
    start's window to its end, its compressed runs the pages of the entries before its end, and their page ids come
    from the persistent block tables.
    """
    assert pad_to is None or (len(rows) <= pad_to.rows and all(len(r.token_ids) == pad_to.tokens_per_row and
                                                                 r.want_logits for r in rows)), \
        "a static batch holds up to key.rows decode (or verify) rows of key.tokens_per_row tokens"
    static = pad_to is not None
    num_pad = pad_to.rows - len(rows) if static else 0
    pad_width = pad_to.tokens_per_row if static else 1
    scratch_slot = kv.state_pool.scratch_slot
    ids = [token for row in rows for token in row.token_ids] + [0] * (num_pad * pad_width)
    slots = _array([row.pages.slot for row in rows] + [scratch_slot] * num_pad)
    starts = _array([row.start_pos for row in rows] + [0] * num_pad)
    lens = _array([len(row.token_ids) for row in rows] + [pad_width] * num_pad)
    num_logits = _array([row.num_logits if row.want_logits else 0 for row in rows] + [pad_width] * num_pad)
    from_previous = _array([row.from_previous_step for row in rows] + [False] * num_pad, np.bool_)
    ends = starts + lens
    single = len(ids) == len(lens)  # one token a row (decodes): row b's token is token b, at its start
    if single:
        offsets = token_seq = np.arange(len(lens))
        within_row, positions = np.zeros(len(ids), np.int64), starts  # (each token the first of its row)
    else:
        offsets = np.cumsum(lens) - lens
        token_seq = np.repeat(np.arange(len(lens)), lens)
        within_row = np.arange(len(ids)) - offsets[token_seq]
        positions = starts[token_seq] + within_row
    real = np.arange(len(lens)) < len(rows)  # padding rows hold no pages: their tables are the scratch page's

    page_size, window_pool = kv.page_size, kv.window_pool
    window_first = np.maximum(starts - kv.window + 1, 0) // page_size
    window_lens = np.where(real, (ends + page_size - 1) // page_size - window_first, 0)
    # (static: the most pages a row of the key's width spans; the window pool's lookahead covers a verify's)
    window_width = (max(window_pool.pages_per_running_request(), -(-(kv.window + pad_width - 1) // page_size) + 1)
                    if static else max(1, int(window_lens.max())))
    window_table = kv.block_table("window", slots, window_first, window_lens, window_width,
                                  window_pool.scratch_page if static else 0)
    # Each token's slot in the window pool: its page in its row's table (padding rows: the scratch page).
    write_page = window_table[token_seq, np.maximum(positions // page_size - window_first[token_seq], 0)]
    write_index = write_page.astype(np.int64) * page_size + positions % page_size

    comp_tables, max_entries, plans = {}, {}, {}
    if compressed:
        comp_tables, max_entries = _compressed_tables(kv, slots, ends, real, rows, pad_to)
        plans = _plans(kv, rows, starts, lens, offsets, slots, single, pad_to, pad_width)

    batch = ForwardBatch(
        input_ids=torch.from_numpy(_array(ids)),
        positions=torch.from_numpy(positions),
        token_seq=torch.from_numpy(token_seq),
        # a row whose tokens the step before leaves on the device: its i-th read from its slot's i-th buffer entry
        token_source=torch.from_numpy(np.where(from_previous[token_seq],
                                               slots[token_seq] * (kv.speculative_tokens + 1) + within_row, -1)),
        logits_token_index=torch.from_numpy(_last_tokens(offsets + lens, num_logits)),
        logits_slot=torch.from_numpy(np.repeat(slots, num_logits)),
        window_write_index=torch.from_numpy(write_index),
        window_block_table=torch.from_numpy(window_table),
        window_first_page=torch.from_numpy(window_first),
        comp_block_tables={name: torch.from_numpy(table) for name, table in comp_tables.items()},
        plans=plans,
        max_entries=max_entries,
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def _compressed_tables(kv: KVCacheManager, slots, ends, real, rows: list[BatchRow],
                       pad_to: StaticKey | None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Each compressed pool's block table [B, C] (the pages of the entries before each row's end) and the most
    entries a token of the batch may attend to (static: the key's context's)."""
    tables, max_entries = {}, {}
    for name, pool in kv.compressed_pools.items():
        comp_lens = np.where(real, pool.pages_for_tokens(ends), 0)
        if pad_to is not None:
            max_entries[name] = pad_to.context // pool.compress_rate
            width = max(1, -(-max_entries[name] // kv.page_size))
        else:
            max_entries[name] = int(ends.max()) // pool.compress_rate if rows else 0
            width = max(1, int(comp_lens.max()))
        tables[name] = kv.block_table(name, slots, np.zeros_like(slots), comp_lens, width,
                                      pool.scratch_page if pad_to is not None else 0)
    return tables, max_entries


def _plans(kv: KVCacheManager, rows: list[BatchRow], starts, lens, offsets, slots, single: bool,
           pad_to: StaticKey | None, pad_width: int) -> dict[str, CompressionPlan]:
    """The step's compression plans: "csa" and the indexer's (one plan: their rings are as long), "hca"; a static
    step's padded to the entries its rows can close at most."""
    model, plans = kv.model, {}
    block = kv.prefix_cache.block_tokens if kv.prefix_cache is not None else None
    # (one token a row, decodes: no snapshot is inside a chunk)
    snapshots = [] if single else [(b, position, slot) for b, row in enumerate(rows) if row.snapshots
                                   for position, slot in row.snapshots]
    # rows of one length (a decode's one token, a verify's 1 + k) take the uniform plan's fast path
    row_length = 1 if single else int(lens[0]) if bool((lens == lens[0]).all()) else None

    def make_plan(rate: int, overlap: bool, ring: int) -> CompressionPlan:
        num_entries = pad_to.rows * entries_per_row(rate, pad_width) if pad_to is not None else None
        snapshot_keep = (pad_to.rows * snapshot_keep_per_row(rate, overlap, pad_width, block)
                         if pad_to is not None else None)
        if row_length is not None and row_length <= rate:
            return build_uniform_plan(rate, overlap, starts, row_length, slots, "cpu", snapshots, ring, num_entries,
                                      snapshot_keep, kv.state_pool.scratch_slot)
        return build_plan(rate, overlap, starts, lens, offsets, slots, "cpu", snapshots, ring, num_entries,
                          snapshot_keep, kv.state_pool.scratch_slot)

    if kv.has_pool("csa"):
        plans["csa"] = plans["indexer"] = make_plan(model.csa_rate, True, kv.ring_length("csa"))
    if kv.has_pool("hca"):
        plans["hca"] = make_plan(model.hca_rate, False, kv.ring_length("hca"))
    return plans


def _array(values: list, dtype=np.int64) -> np.ndarray:
    """An array of a list of Python numbers (numpy's conversion is 4x faster than torch.tensor's: it runs for every
    row of every step)."""
    return np.array(values, dtype=dtype)


def _last_tokens(row_ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Batch indices of the last counts[r] tokens of each row r (rows end at row_ends), row after row."""
    if bool((counts <= 1).all()):  # (every row one or none: the common case, without the expansion)
        return (row_ends - 1)[counts == 1]
    row = np.repeat(np.arange(len(counts)), counts)
    rank = np.arange(len(row)) - (np.cumsum(counts) - counts)[row]
    return row_ends[row] - counts[row] + rank
