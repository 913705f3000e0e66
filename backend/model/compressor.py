"""Compressors of CSA/HCA layers (and the CSA indexer) over a ragged batch with ring-buffer state.

Entry w of a compressor with rate m is a gated, softmax-weighted sum of token projections:
  HCA (no overlap):  the m tokens of window w, gate + position_bias[i];
  CSA (overlap):     the m tokens of window w-1 through the first half of the projection ("Ca")
                     and the m tokens of window w through the second half ("Cb"), 2m slots in all;
                     for w = 0 the Ca half is empty (weight 0).
It is then RMS-normed and rotated (compress rope) at position w * m. Entry w is ready once token
(w + 1) * m - 1 has been projected, and depends on nothing else, so a chunked prefill or a decode
computes exactly the entries a full forward would. The math is `compress_into_pool_reference` in
kernels/compressor.py.

Per step, a `CompressionPlan` (one per rate/overlap kind, shared by all layers of that kind) says
which entries close in this batch, where each of their source tokens is (in the request's ring of
earlier tokens or in this batch), where to store the entry, and which tokens to keep in the ring.
It may also snapshot a row's ring at a position P inside its chunk (prefix caching keeps the state at
every block boundary): the positions a continuation from P reads from the ring are written into
another slot (a spare one, backend/memory/compressor_state.py) like any ring update. These snapshot
rows come first among the keep rows (`num_snapshot_keep` of them): they may read ring positions
before the chunk, which the chunk's own ring updates overwrite, so the kernel writes them with the
entries, before the ring updates (kernels/compressor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch


def _per_entry(pad_value):
    """A field with one row per closing entry; a static-shape step pads it with `pad_value` (static_batch.py)."""
    return field(metadata={"per_entry": pad_value})


@dataclass
class CompressionPlan:
    rate: int
    overlap: bool
    ring: int
    ring_slots: torch.Tensor  # [B] state slot of each batch row
    ring_order: torch.Tensor  # [B, ring] ring index of positions start - ring .. start - 1
    entry_src: torch.Tensor = _per_entry(0)  # [N, span] index into cat(ring rows flattened, batch tokens)
    entry_valid: torch.Tensor = _per_entry(True)  # [N, span] False for positions before 0
    entry_pos: torch.Tensor = _per_entry(0)  # [N] rope position w * rate
    entry_row: torch.Tensor = _per_entry(-1)  # [N] batch row (-1: a padding entry, stored to the scratch page)
    entry_index: torch.Tensor = _per_entry(0)  # [N] w
    keep_src: torch.Tensor  # [M] index into the same source of the tokens the ring keeps
    keep_slot: torch.Tensor  # [M]
    keep_pos: torch.Tensor  # [M] ring index
    num_snapshot_keep: int = 0  # the first keep rows are snapshots (into spare slots), the rest ring updates

    @property
    def num_entries(self) -> int:
        return int(self.entry_src.shape[0])


_PAD_VALUES = {f.name: f.metadata["per_entry"] for f in fields(CompressionPlan) if "per_entry" in f.metadata}


# The plans are index arithmetic over a few values per row, built on the host for every step: in numpy, whose
# operations on such small arrays cost a fraction of torch's (a step's host time is mostly this and the batch's own
# arithmetic, backend/model/forward_batch.py), and handed over as torch tensors sharing the arrays' memory.
def build_plan(rate: int, overlap: bool, row_starts, row_lens, row_token_offsets, row_slots, device="cpu",
               snapshots: list[tuple[int, int, int]] = (), ring: int | None = None,
               num_entries: int | None = None, num_snapshot_keep: int | None = None,
               scratch_slot: int = 0) -> CompressionPlan:
    """Index arithmetic for one step; rows are (first position, token count, offset in batch, slot), as lists or
    integer arrays (numpy, or torch on the host); snapshots are (row, position P, slot): the ring as it stands at P,
    written into that slot. `ring`: the positions a ring keeps (default: the span of a window, 2 * rate with overlap;
    speculative decoding keeps more, KVCacheManager.ring_length). `num_entries`: exactly that many entries, padding
    after the real ones; `num_snapshot_keep`: exactly that many snapshot keep rows, padding after the real ones
    written into `scratch_slot` (a static-shape step, backend/model/static_batch.py).

    Vectorised over rows (a constant number of array operations whatever the batch size).
    """
    span = 2 * rate if overlap else rate
    ring = ring or span
    start, length, offset, slot = (_ints(v) for v in (row_starts, row_lens, row_token_offsets, row_slots))
    rows = np.arange(len(start))

    # Entries: window w closes in this chunk when its last token (w + 1) * rate - 1 is in [start, start + len).
    first_w = np.maximum(-(-(start + 1) // rate) - 1, 0)
    counts = np.maximum((start + length) // rate - first_w, 0)
    entry_row, rank = _expand(rows, counts)
    entry_index = first_w[entry_row] + rank
    lo = (entry_index - 1) * rate if overlap else entry_index * rate
    positions = lo[:, None] + np.arange(span)[None, :]  # [N, span]
    entry_src = _source_index(np.maximum(positions, 0), entry_row[:, None], start[entry_row, None],
                              offset[entry_row, None], ring, len(start))

    # The ring keeps the row's last `ring` positions; only those inside this chunk are new.
    kept = np.minimum(length, ring)
    keep_row, keep_rank = _expand(rows, kept)
    keep = (start + length - kept)[keep_row] + keep_rank
    keep_src = _source_index(keep, keep_row, start[keep_row], offset[keep_row], ring, len(start))
    keep_slot, keep_pos = slot[keep_row], keep % ring
    snap_src, snap_slot, snap_pos = _snapshot_keep_rows(rate, overlap, ring, snapshots, start, length, offset,
                                                        num_snapshot_keep, scratch_slot)
    num_snapshot_keep = len(snap_src)
    if num_snapshot_keep:
        keep_src, keep_slot = np.concatenate([snap_src, keep_src]), np.concatenate([snap_slot, keep_slot])
        keep_pos = np.concatenate([snap_pos, keep_pos])
    return _plan(rate, overlap, ring, device, num_entries, num_snapshot_keep, ring_slots=slot,
                 ring_order=(start[:, None] - ring + np.arange(ring)[None, :]) % ring,
                 entry_src=entry_src, entry_valid=positions >= 0, entry_pos=entry_index * rate, entry_row=entry_row,
                 entry_index=entry_index, keep_src=keep_src, keep_slot=keep_slot, keep_pos=keep_pos)


def build_uniform_plan(rate: int, overlap: bool, row_starts, tokens_per_row: int, row_slots, device="cpu",
                       snapshots: list[tuple[int, int, int]] = (), ring: int | None = None,
                       num_entries: int | None = None, num_snapshot_keep: int | None = None,
                       scratch_slot: int = 0) -> CompressionPlan:
    """build_plan for rows of `tokens_per_row` tokens each, at most `rate` (a decode step's one, a verify step's 1 + k),
    row b's at batch offset b * tokens_per_row: the same plan in a third of the array operations (a step's host time
    does not grow with its batch's Python). Each row closes at most one window, and its ring keeps all of its
    tokens."""
    length = tokens_per_row
    span = 2 * rate if overlap else rate
    ring = ring or span
    assert 1 <= length <= rate <= ring, "a row closes at most one window and its ring keeps all of its tokens"
    start, slot = _ints(row_starts), _ints(row_slots)
    num_rows = len(start)
    rows = np.arange(num_rows)
    last_end = (start + length) // rate * rate - 1  # the last window end among the row's positions, if any
    closes = last_end >= start
    entry_row = rows[closes]
    closing_start = start[closes][:, None]
    entry_index = (last_end[closes] + 1) // rate - 1
    lo = (entry_index - 1) * rate if overlap else entry_index * rate
    positions = lo[:, None] + np.arange(span)[None, :]  # [N, span]: the window's last is one of the row's tokens
    source = np.maximum(positions, 0)  # (positions before 0 are invalid, read from anywhere)
    from_ring = entry_row[:, None] * ring + (source - (closing_start - ring))
    from_batch = num_rows * ring + entry_row[:, None] * length + (source - closing_start)
    keep_src = num_rows * ring + np.arange(num_rows * length)
    keep_slot = np.repeat(slot, length)
    keep_pos = (start[:, None] + np.arange(length)[None, :]).reshape(-1) % ring
    if snapshots or num_snapshot_keep:  # (as build_plan's)
        snap_src, snap_slot, snap_pos = _snapshot_keep_rows(rate, overlap, ring, snapshots, start,
                                                            np.full(num_rows, length), rows * length,
                                                            num_snapshot_keep, scratch_slot)
        keep_src, keep_slot = np.concatenate([snap_src, keep_src]), np.concatenate([snap_slot, keep_slot])
        keep_pos = np.concatenate([snap_pos, keep_pos])
        num_snapshot_keep = len(snap_src)
    return _plan(rate, overlap, ring, device, num_entries, num_snapshot_keep or 0, ring_slots=slot,
                 ring_order=(start[:, None] - ring + np.arange(ring)[None, :]) % ring,
                 entry_src=np.where(source < closing_start, from_ring, from_batch), entry_valid=positions >= 0,
                 entry_pos=entry_index * rate, entry_row=entry_row, entry_index=entry_index, keep_src=keep_src,
                 keep_slot=keep_slot, keep_pos=keep_pos)


def _plan(rate: int, overlap: bool, ring: int, device, num_entries: int | None, num_snapshot_keep: int,
          **arrays: np.ndarray) -> CompressionPlan:
    """The plan of `arrays` as tensors on `device`; with `num_entries`, every per-entry field padded to that many
    rows with its pad value (entry_row -1: computed from source 0, finite, and stored to the scratch page)."""
    if num_entries is not None:
        missing = num_entries - len(arrays["entry_row"])
        assert missing >= 0, "a static step closes at most entries_per_row windows per row"
        for name, value in _PAD_VALUES.items():
            a = arrays[name]
            arrays[name] = np.concatenate([a, np.full((missing, *a.shape[1:]), value, dtype=a.dtype)])
    tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
    if torch.device(device).type != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return CompressionPlan(rate=rate, overlap=overlap, ring=ring, num_snapshot_keep=num_snapshot_keep, **tensors)


def _ints(values) -> np.ndarray:
    """int64 array of a list, an array or a tensor of integers (an empty list included)."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    return np.asarray(values, dtype=np.int64)


def _snapshot_lookback(rate: int, overlap: bool, position: int) -> int:
    """How many positions before `position` a continuation from there reads from the ring: the open window,
    and with overlap the window before it (CSA's Ca half)."""
    return position % rate + (rate if overlap else 0)


def _snapshot_keep_rows(rate, overlap, ring, snapshots, start, length, offset, num_snapshot_keep, scratch_slot):
    """The snapshots' keep rows (source, slot, ring index); with `num_snapshot_keep`, padded to exactly that many with
    source 0 into the scratch slot's ring, which no row reads (a static step)."""
    snap_src = snap_slot = snap_pos = np.zeros(0, dtype=np.int64)
    if snapshots:
        snap_src, snap_slot, snap_pos = _snapshot_rows(rate, overlap, ring, snapshots, start, length, offset)
    if num_snapshot_keep is not None:
        missing = num_snapshot_keep - len(snap_src)
        assert missing >= 0, "a static step's rows keep at most snapshot_keep_per_row snapshot positions each"
        snap_src, snap_pos = (np.concatenate([a, np.zeros(missing, dtype=np.int64)]) for a in (snap_src, snap_pos))
        snap_slot = np.concatenate([snap_slot, np.full(missing, scratch_slot, dtype=np.int64)])
    return snap_src, snap_slot, snap_pos


def _snapshot_rows(rate, overlap, ring, snapshots, start, length, offset):
    """(source, slot, ring index) of the ring positions each snapshot keeps: computed in this batch, or still in
    the row's ring (positions just before its chunk)."""
    row, position, dest = (np.array(v, dtype=np.int64) for v in zip(*snapshots))
    lookback = np.array([_snapshot_lookback(rate, overlap, int(p)) for p in position], dtype=np.int64)
    first = position - lookback
    assert bool(((first >= start[row] - ring) & (position > start[row])
                 & (position <= start[row] + length[row])).all()), \
        "a snapshot is of a position in its row's chunk, whose ring positions are in the batch or the ring"
    which, rank = _expand(np.arange(len(snapshots)), lookback)
    positions, rows = first[which] + rank, row[which]
    src = _source_index(positions, rows, start[rows], offset[rows], ring, len(start))
    return src, dest[which], positions % ring


def _expand(rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each item, rank of the item within its row) for `counts[r]` items per row."""
    row = np.repeat(rows, counts)
    first = np.cumsum(counts) - counts
    return row, np.arange(len(row)) - first[row]


def _source_index(positions, row, start, offset, ring: int, num_rows: int):
    """Positions before `start` come from the row's ring (block `row`), the rest from the batch."""
    from_ring = row * ring + (positions - (start - ring))
    from_batch = num_rows * ring + offset + (positions - start)
    return np.where(positions < start, from_ring, from_batch)
