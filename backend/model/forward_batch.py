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
has not seen (overlap scheduling). Such a row says so (`from_previous_step`), and the batch's
`token_source_slot` tells the executor to read that token from its last-token buffer (by the request's
state slot) before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.memory.kv_manager import KVCacheManager, RequestPages
from backend.model.compressor import CompressionPlan, build_plan
from backend.model.staging import map_leaves
from backend.model.static_batch import StaticKey, pad_plan


@dataclass(slots=True)
class BatchRow:
    pages: RequestPages  # the request's memory (allocated for these tokens)
    token_ids: list[int]  # the row's tokens to compute (a from_previous_step row: its one token is a stand-in)
    start_pos: int
    want_logits: bool  # the chunk reaches the end of the sequence: sample a token
    # (position P, spare state slot): keep the compressor rings as they stand at P, in (start, end], in that slot
    # (prefix caching, backend/memory/prefix_cache.py)
    snapshots: tuple[tuple[int, int], ...] = ()
    from_previous_step: bool = False  # its one token is the one the step in flight samples for this request


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    token_seq: torch.Tensor  # [T] long, the row of each token
    token_source_slot: torch.Tensor  # [T] long: -1, or the state slot whose last sampled token is this token's id
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

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device) -> "ForwardBatch":
        """A copy with every tensor on `device` (a plan shared by two streams stays shared)."""
        return map_leaves(self, lambda t: t.to(device, copy=True))


def build_forward_batch(rows: list[BatchRow], kv: KVCacheManager, device="cpu",
                        pad_to: StaticKey | None = None) -> ForwardBatch:
    """The batch of `rows`, built on the host (then moved to `device` if that is not the host); with `pad_to`, padded
    to that static shape (decode rows only): logits for every row, padding rows included."""
    assert pad_to is None or (len(rows) <= pad_to.rows and all(len(r.token_ids) == 1 and r.want_logits
                                                                 for r in rows)), \
        "a static batch holds up to key.rows decode rows"
    ids, token_source_slot, logits_index, logits_slot = [], [], [], []
    starts, lens, offsets, slots, snapshots = [], [], [], [], []
    window_firsts, window_lens = [], []
    comp_lens = {name: [] for name in kv.compressed_pools}
    page_size, sliding_window = kv.page_size, kv.window
    for b, row in enumerate(rows):
        n, offset, slot = len(row.token_ids), len(ids), row.pages.slot
        ids.extend(row.token_ids)
        if row.from_previous_step:
            token_source_slot.append(slot)
        else:
            token_source_slot.extend([-1] * n)
        if row.want_logits:
            logits_index.append(offset + n - 1)
            logits_slot.append(slot)
        runs = row.pages.runs
        window = runs["window"]  # its pages before the window of start_pos may not be released yet
        first = max(window.first, max(0, row.start_pos - sliding_window + 1) // page_size)
        window_firsts.append(first)
        window_lens.append(window.end - first)
        for name, lengths in comp_lens.items():
            run = runs.get(name)
            lengths.append(len(run.pages) if run is not None else 0)
        starts.append(row.start_pos)
        lens.append(n)
        offsets.append(offset)
        slots.append(slot)
        snapshots.extend((b, position, snapshot_slot) for position, snapshot_slot in row.snapshots)

    if pad_to is not None:  # padding rows: token 0 at position 0 of the scratch slot and pages
        for b in range(len(rows), pad_to.rows):
            scratch = kv.state_pool.scratch_slot
            logits_index.append(len(ids))
            logits_slot.append(scratch)
            ids.append(0)
            token_source_slot.append(-1)
            window_firsts.append(0)
            window_lens.append(0)
            for lengths in comp_lens.values():
                lengths.append(0)
            starts.append(0)
            lens.append(1)
            offsets.append(b)
            slots.append(scratch)

    def long(values):
        return torch.tensor(values, dtype=torch.long)

    slots_t, starts_t, lens_t = long(slots), long(starts), long(lens)
    token_seq = torch.repeat_interleave(torch.arange(len(lens)), lens_t)
    positions = starts_t[token_seq] + torch.arange(len(ids)) - long(offsets)[token_seq]
    window_pool = kv.window_pool
    window_firsts_t, window_lens_t = long(window_firsts), long(window_lens)
    window_width = window_pool.pages_per_running_request() if pad_to is not None else max(1, max(window_lens))
    window_table = kv.block_table("window", slots_t, window_firsts_t, window_lens_t, window_width,
                                  window_pool.scratch_page if pad_to is not None else 0)
    # Each token's slot in the window pool: its page in its row's table (padding rows: the scratch page).
    write_page = window_table[token_seq, (positions // page_size - window_firsts_t[token_seq]).clamp(min=0)]
    write_index = write_page.long() * page_size + positions % page_size

    comp_tables, max_entries = {}, {}
    for name, pool in kv.compressed_pools.items():
        if pad_to is not None:
            entries = pad_to.context // pool.compress_rate
            width = max(1, -(-entries // page_size))
        else:
            entries = max((s + n) // pool.compress_rate for s, n in zip(starts, lens)) if rows else 0
            width = max(1, max(comp_lens[name]))
        comp_tables[name] = kv.block_table(name, slots_t, torch.zeros_like(slots_t), long(comp_lens[name]), width,
                                           pool.scratch_page if pad_to is not None else 0)
        max_entries[name] = entries

    plans = {}
    model = kv.model
    if kv.has_pool("csa"):
        plans["csa"] = plans["indexer"] = build_plan(model.csa_rate, True, starts, lens, offsets, slots, "cpu",
                                                     snapshots)
    if kv.has_pool("hca"):
        plans["hca"] = build_plan(model.hca_rate, False, starts, lens, offsets, slots, "cpu", snapshots)
    if pad_to is not None:  # a decode row closes at most one window per compressor: exactly `rows` entries
        padded = {id(plan): pad_plan(plan, pad_to.rows) for plan in plans.values()}
        plans = {stream: padded[id(plan)] for stream, plan in plans.items()}

    batch = ForwardBatch(
        input_ids=long(ids),
        positions=positions,
        token_seq=token_seq,
        token_source_slot=long(token_source_slot),
        logits_token_index=long(logits_index),
        logits_slot=long(logits_slot),
        window_write_index=write_index,
        window_block_table=window_table,
        window_first_page=window_firsts_t,
        comp_block_tables=comp_tables,
        plans=plans,
        max_entries=max_entries,
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)
