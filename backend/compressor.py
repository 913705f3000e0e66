"""Compressors of CSA/HCA layers (and the CSA indexer) over a ragged batch with ring-buffer state.

Entry w of a compressor with rate m is a gated, softmax-weighted sum of token projections:
  HCA (no overlap):  the m tokens of window w, gate + position_bias[i];
  CSA (overlap):     the m tokens of window w-1 through the first half of the projection ("Ca")
                     and the m tokens of window w through the second half ("Cb"), 2m slots in all;
                     for w = 0 the Ca half is empty (weight 0).
It is then RMS-normed and rotated (compress rope) at position w * m. Entry w is ready once token
(w + 1) * m - 1 has been projected, and depends on nothing else, so a chunked prefill or a decode
computes exactly the entries a full forward would.

Per step, a `CompressionPlan` (one per rate/overlap kind, shared by all layers of that kind) says
which entries close in this batch, where each of their source tokens is (in the request's ring of
earlier tokens or in this batch), where to store the entry, and which tokens to keep in the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.layers import apply_rope, rms_norm


@dataclass
class CompressionPlan:
    rate: int
    overlap: bool
    ring: int
    ring_slots: torch.Tensor  # [B] state slot of each batch row
    ring_order: torch.Tensor  # [B, ring] ring index of positions start - ring .. start - 1
    entry_src: torch.Tensor  # [N, span] index into cat(ring rows flattened, batch tokens)
    entry_valid: torch.Tensor  # [N, span] False for positions before 0
    entry_pos: torch.Tensor  # [N] rope position w * rate
    entry_row: torch.Tensor  # [N] batch row
    entry_index: torch.Tensor  # [N] w
    keep_src: torch.Tensor  # [M] index into the same source of the tokens the ring keeps
    keep_slot: torch.Tensor  # [M]
    keep_pos: torch.Tensor  # [M] ring index

    @property
    def num_entries(self) -> int:
        return int(self.entry_src.shape[0])


def build_plan(rate: int, overlap: bool, row_starts: list[int], row_lens: list[int], row_token_offsets: list[int],
               row_slots: list[int], device) -> CompressionPlan:
    """Index arithmetic for one step; rows are (first position, token count, offset in batch, slot)."""
    ring = 2 * rate if overlap else rate
    span = ring
    num_rows = len(row_starts)
    entry_src, entry_valid, entry_pos, entry_row, entry_index = [], [], [], [], []
    keep_src, keep_slot, keep_pos = [], [], []
    ring_order = []
    for b, (start, length, offset, slot) in enumerate(zip(row_starts, row_lens, row_token_offsets, row_slots)):
        ring_order.append([(start - ring + i) % ring for i in range(ring)])
        first_w = max(0, -(-(start + 1) // rate) - 1)  # first window whose last token is >= start
        last_w = (start + length) // rate - 1  # last window closed by this chunk
        if last_w >= first_w:
            w = torch.arange(first_w, last_w + 1)
            lo = (w - 1) * rate if overlap else w * rate
            positions = lo[:, None] + torch.arange(span)[None, :]  # [n, span]
            entry_valid.append(positions >= 0)
            entry_src.append(_source_index(positions.clamp(min=0), b, start, offset, ring, num_rows))
            entry_pos.append(w * rate)
            entry_row.append(torch.full_like(w, b))
            entry_index.append(w)
        keep = torch.arange(max(start, start + length - ring), start + length)
        keep_src.append(_source_index(keep, b, start, offset, ring, num_rows))
        keep_slot.append(torch.full_like(keep, slot))
        keep_pos.append(keep % ring)

    def cat(parts, shape=(0,), dtype=torch.long):
        return torch.cat(parts).to(device) if parts else torch.zeros(shape, dtype=dtype, device=device)

    return CompressionPlan(
        rate=rate, overlap=overlap, ring=ring,
        ring_slots=torch.tensor(row_slots, dtype=torch.long, device=device),
        ring_order=torch.tensor(ring_order, dtype=torch.long, device=device).view(num_rows, ring),
        entry_src=cat(entry_src, (0, span)), entry_valid=cat(entry_valid, (0, span), torch.bool),
        entry_pos=cat(entry_pos), entry_row=cat(entry_row), entry_index=cat(entry_index),
        keep_src=cat(keep_src), keep_slot=cat(keep_slot), keep_pos=cat(keep_pos),
    )


def _source_index(positions: torch.Tensor, row: int, start: int, offset: int, ring: int, num_rows: int):
    """Positions before `start` come from the row's ring (block `row`), the rest from the batch."""
    from_ring = row * ring + (positions - (start - ring))
    from_batch = num_rows * ring + offset + (positions - start)
    return torch.where(positions < start, from_ring, from_batch)


def compress(kv: torch.Tensor, gate: torch.Tensor, state_kv: torch.Tensor, state_gate: torch.Tensor,
             plan: CompressionPlan, position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
             rope_cos_sin) -> torch.Tensor:
    """Entries closed in this step [N, head_dim]; updates the ring state in place.

    kv, gate: this batch's projections [T, width]; state_*: one layer's rings [slots, ring, width];
    rope_cos_sin: positions -> (cos, sin) of the compress rope.
    """
    width = kv.shape[-1]
    ring_kv = state_kv[plan.ring_slots[:, None], plan.ring_order].reshape(-1, width)
    ring_gate = state_gate[plan.ring_slots[:, None], plan.ring_order].reshape(-1, width)
    src_kv, src_gate = torch.cat([ring_kv, kv]), torch.cat([ring_gate, gate])
    state_kv[plan.keep_slot, plan.keep_pos] = src_kv[plan.keep_src]
    state_gate[plan.keep_slot, plan.keep_pos] = src_gate[plan.keep_src]
    if plan.num_entries == 0:
        return kv.new_zeros((0, norm_weight.shape[0]))
    win_kv, win_gate = src_kv[plan.entry_src], src_gate[plan.entry_src]  # [N, span, width]
    if plan.overlap:
        head_dim, rate = width // 2, plan.rate
        win_kv = torch.cat([win_kv[:, :rate, :head_dim], win_kv[:, rate:, head_dim:]], dim=1)
        win_gate = torch.cat([win_gate[:, :rate, :head_dim] + position_bias[:, :head_dim],
                              win_gate[:, rate:, head_dim:] + position_bias[:, head_dim:]], dim=1)
    else:
        win_gate = win_gate + position_bias
    valid = plan.entry_valid[..., None]
    win_kv = torch.where(valid, win_kv, torch.zeros_like(win_kv))
    win_gate = win_gate.masked_fill(~valid, float("-inf"))
    weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
    entries = rms_norm((win_kv * weights).sum(dim=1), norm_weight, eps)
    cos, sin = rope_cos_sin(plan.entry_pos)
    return apply_rope(entries, cos, sin)
