"""DeepSeek-V4's compressors (CSA with overlap, HCA, the CSA indexer keys): close windows into the pools.

Entry w of a compressor with rate m is a gated, softmax-weighted sum of token projections (HCA: the m tokens
of window w, gate + position_bias; CSA: window w-1 through the first half of the projection and window w
through the second half), RMS-normed and rotated (compress rope) at position w * m: see
backend/model/compressor.py, which builds the per-step `CompressionPlan` on the host.

`compress_into_pool_reference` reads the request rings and this batch's projections, updates the rings,
computes the entries the plan closes and stores each at page block_table[entry_row, entry_index // page_size],
slot entry_index % page_size of `pool` [pages, page_size, d]. Entries with entry_row < 0 are padding (static
shapes for CUDA graphs): they go to the pool's last page, the scratch page no request owns
(backend/memory/paged_pool.py), so no mask or data-dependent shape is needed. Only the torch definition exists so far: the GPU path runs it too.
"""

from __future__ import annotations

import torch

from kernels.norm_rope import apply_rope, rms_norm


def compress_into_pool_reference(kv: torch.Tensor, gate: torch.Tensor, state_kv: torch.Tensor,
                                 state_gate: torch.Tensor, plan, position_bias: torch.Tensor,
                                 norm_weight: torch.Tensor, eps: float, entry_cos: torch.Tensor,
                                 entry_sin: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor) -> None:
    """kv, gate: this batch's projections [T, width] (may be column views); state_*: one layer's rings
    [slots, ring, width]; entry_cos / entry_sin: the compress rope at plan.entry_pos."""
    entries = _compress(kv, gate, state_kv, state_gate, plan, position_bias, norm_weight, eps, entry_cos, entry_sin)
    if plan.num_entries == 0:
        return
    page_size, index = pool.shape[1], plan.entry_index
    pages = block_table[plan.entry_row.clamp(min=0), index // page_size].long()
    dest = torch.where(plan.entry_row >= 0, pages * page_size + index % page_size, (pool.shape[0] - 1) * page_size)
    pool.view(-1, pool.shape[-1])[dest] = entries


def _compress(kv: torch.Tensor, gate: torch.Tensor, state_kv: torch.Tensor, state_gate: torch.Tensor,
              plan, position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, entry_cos: torch.Tensor,
              entry_sin: torch.Tensor) -> torch.Tensor:
    """Entries closed in this step [N, head_dim]; updates the ring state in place.

    kv, gate: this batch's projections [T, width]; state_*: one layer's rings [slots, ring, width].
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
    return apply_rope(entries, entry_cos, entry_sin)
