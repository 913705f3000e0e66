"""Lightning indexer scores for CSA layers: which compressed entries each query attends to.

Math, for query token t (batch row b = token_seq[t], position p = token_pos[t]) and entry e:
  score[t, e] = sum_h weights[t, h] * ReLU(q[t, h] . k[e]) * softmax_scale    if e < (p + 1) // compress_rate
              = -inf                                                           otherwise (not yet causal)
`weights` already carries the indexer's head scaling (index_n_heads ** -0.5). Scores are fp32.
The top-k over these scores is taken with torch by the caller.

Layouts:
  q            [T, H_I, d_I]
  weights      [T, H_I] fp32
  index_k      [num_pages, page_size, d_I]   (one CSA layer's slice of the indexer-key pool), or uint8
               [num_pages, page_size, d_I / 2 + d_I / 32]: FP4 keys (kv_cache_dtype fp8, kernels/quant_formats.py)
  block_table  [B, C] int32, entry e of row b at page block_table[b, e // page_size], slot e % page_size
Returns [T, max_entries] with max_entries = max over t of (p + 1) // compress_rate.

Kernel (`indexer_scores_triton`): one program per (query token, block of BLOCK_E entries); grid
(T, cdiv(max_entries, BLOCK_E)). It gathers the block's keys [BLOCK_E, d_I] through the page table once, then
loops over blocks of BLOCK_H heads: dots = q[t, heads] @ k^T [BLOCK_H, BLOCK_E] (tl.dot, fp32 accumulate),
score += sum_h w[t, h] * softmax_scale * ReLU(dots). Blocks past the token's causal entries skip the head loop.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from kernels.common import compute_dtype, launch, row_alignment, wait_for_previous_kernel
from kernels.quant_formats import decode_indexer_keys, indexer_fp4_entry_bytes, load_indexer_keys
from kernels.tuning import dtype_name, tuned


@triton.jit(do_not_specialize=["max_entries", "stride_st"])  # vary with the context: never recompile per step
def _indexer_scores_kernel(
    # pointers
    q_ptr, weights_ptr, token_seq_ptr, token_pos_ptr, index_k_ptr, block_table_ptr, scores_ptr,
    # sizes
    num_heads, compress_rate, page_size, max_entries, softmax_scale,
    # strides (the last dimension of every tensor is contiguous)
    stride_qt, stride_qh, stride_wt, stride_kpage, stride_kslot, stride_table_b, stride_st,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KEYS_FP4: tl.constexpr,  # a pool of FP4 keys' bytes (kernels/quant_formats.py)
    ALIGN: tl.constexpr,  # the keys start at multiples of ALIGN elements
    PDL: tl.constexpr = False,  # launched to wait for the kernel before it (common.launch)
):
    """Program (token t, block of BLOCK_E entries): gather the keys once, loop over head blocks."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    entries = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    num_causal = (tl.load(token_pos_ptr + t).to(tl.int64) + 1) // compress_rate
    is_causal = entries < num_causal
    dims = tl.arange(0, HEAD_DIM)

    page = tl.load(block_table_ptr + seq * stride_table_b + entries // page_size, mask=is_causal, other=0)
    k = load_indexer_keys(index_k_ptr, page.to(tl.int64), entries % page_size, stride_kpage, stride_kslot, is_causal,
                          HEAD_DIM, KEYS_FP4, COMPUTE_DTYPE, ALIGN)  # [BLOCK_E, HEAD_DIM]
    acc = tl.zeros([BLOCK_E], tl.float32)
    # A block with no causal entry skips the head loop and only writes -inf.
    num_head_blocks = tl.where(tl.program_id(1) * BLOCK_E < num_causal, tl.cdiv(num_heads, BLOCK_H), 0)
    for head_block in range(0, num_head_blocks):
        heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        head_mask = heads < num_heads
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_mask[:, None], other=0.0).to(COMPUTE_DTYPE)  # [BLOCK_H, HEAD_DIM]
        w = tl.load(weights_ptr + t * stride_wt + heads, mask=head_mask, other=0.0).to(tl.float32)
        dots = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_E] fp32
        acc += tl.sum(tl.maximum(dots, 0.0) * softmax_scale * w[:, None], 0)
    scores = tl.where(is_causal, acc, float("-inf"))
    tl.store(scores_ptr + t * stride_st + entries, scores, mask=entries < max_entries)


def indexer_config(head_dim: int, num_heads: int) -> dict:
    """Tile sizes and launch options (shared with scripts/)."""
    block_h = min(64, max(16, triton.next_power_of_2(num_heads)))
    return dict(BLOCK_H=block_h, BLOCK_E=128 if head_dim <= 128 else 64, num_warps=4, num_stages=2)


def plan_indexer_scores(q, weights, softmax_scale, token_seq, token_pos, index_k, block_table, compress_rate,
                        *, max_entries=None, block_e=None):
    """Check the inputs, allocate the scores and return (scores, launches) without launching anything.

    max_entries: the scores' width, max_t (token_pos[t] + 1) // compress_rate. None computes it, which reads
    token_pos on the host (a device synchronisation); pass it to avoid that. block_e: tile override for tests.
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_indexer_inputs(q, weights, token_seq, token_pos, index_k, block_table, compress_rate)
    if max_entries is None:
        max_entries = int(((token_pos.max() + 1) // compress_rate).item()) if num_tokens else 0
    scores = torch.empty((num_tokens, max_entries), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or max_entries == 0:
        return scores, []
    keys_fp4 = index_k.dtype == torch.uint8
    shape = dict(head_dim=head_dim, heads=num_heads, dtype=dtype_name(q.dtype), tokens=num_tokens,
                 keys="fp4" if keys_fp4 else dtype_name(index_k.dtype))
    cfg = tuned("indexer", shape, indexer_config(head_dim, num_heads))
    block_e = block_e or cfg["BLOCK_E"]
    dot_dtype = compute_dtype(q.dtype)
    args = (q, weights, token_seq, token_pos, index_k, block_table, scores,
            num_heads, compress_rate, index_k.shape[1], max_entries, float(softmax_scale),
            q.stride(0), q.stride(1), weights.stride(0), index_k.stride(0), index_k.stride(1), block_table.stride(0),
            scores.stride(0))
    kwargs = dict(HEAD_DIM=head_dim, BLOCK_H=cfg["BLOCK_H"], BLOCK_E=block_e, COMPUTE_DTYPE=dot_dtype,
                  DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", KEYS_FP4=keys_fp4,
                  ALIGN=row_alignment(*index_k.stride()[:2]),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return scores, [(_indexer_scores_kernel, (num_tokens, triton.cdiv(max_entries, block_e)), args, kwargs)]


def _check_indexer_inputs(q, weights, token_seq, token_pos, index_k, block_table, compress_rate):
    num_tokens, num_heads, head_dim = q.shape
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype} not supported"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "index head_dim must be a power of two >= 16"
    assert q.stride(2) == 1, "q's last dimension must be contiguous"
    assert weights.shape == (num_tokens, num_heads) and weights.is_floating_point() and weights.stride(1) == 1
    for name, ids in (("token_seq", token_seq), ("token_pos", token_pos)):
        assert ids.shape == (num_tokens,), f"{name} must be [T], got {tuple(ids.shape)}"
        assert ids.dtype in (torch.int32, torch.int64) and ids.stride(0) == 1, f"{name}: int32/int64 contiguous"
    if index_k.dtype == torch.uint8:  # FP4 keys
        width = indexer_fp4_entry_bytes(head_dim)
        assert index_k.dim() == 3 and index_k.shape[2] == width, f"FP4 index_k must be [pages, page_size, {width}]"
    else:
        assert index_k.dim() == 3 and index_k.shape[2] == head_dim, "index_k must be [pages, page_size, d_I]"
        assert index_k.dtype == q.dtype, "index_k: q's dtype"
    assert index_k.stride(2) == 1, "index_k's last dimension must be contiguous"
    assert block_table.dim() == 2 and block_table.dtype in (torch.int32, torch.int64) and block_table.stride(1) == 1
    assert compress_rate >= 1, f"compress_rate must be >= 1, got {compress_rate}"


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    index_k: torch.Tensor,
    block_table: torch.Tensor,
    compress_rate: int,
    *,
    max_entries: int | None = None,
    block_e: int | None = None,
) -> torch.Tensor:
    """Triton version of `indexer_scores_reference` (same arguments, [T, max_entries] fp32, -inf if not causal).

    max_entries: pass it to skip the host read of token_pos (see `plan_indexer_scores`).
    """
    scores, launches = plan_indexer_scores(q, weights, softmax_scale, token_seq, token_pos, index_k, block_table,
                                           compress_rate, max_entries=max_entries, block_e=block_e)
    launch(launches)
    return scores



_REFERENCE_TILE = 256


def indexer_scores_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    token_seq: torch.Tensor,
    token_pos: torch.Tensor,
    index_k: torch.Tensor,
    block_table: torch.Tensor,
    compress_rate: int,
    *,
    max_entries: int | None = None,
) -> torch.Tensor:
    """Plain-torch definition of the kernel (see the module docstring). Returns [T, max_entries] fp32.

    max_entries: the scores' width (at least the widest causal count; columns past a token's causal entries
    are -inf); None computes it from token_pos.

    The tokens of one prefill chunk share their keys, so a request with several tokens gathers its
    keys once and scores its tokens in tiles; single tokens (decodes) are scored together, each with
    its own gathered keys. Both compute the same formula.
    """
    num_tokens = q.shape[0]
    num_causal = (token_pos.long() + 1) // compress_rate
    if max_entries is None:
        max_entries = int(num_causal.max().item()) if num_tokens else 0
    scores = torch.full((num_tokens, max_entries), float("-inf"), dtype=torch.float32, device=q.device)
    if max_entries == 0:
        return scores
    seq = token_seq.long()
    rows, counts = torch.unique(seq, return_counts=True)
    lone = torch.isin(seq, rows[counts == 1]).nonzero().flatten()
    _score_tokens_with_own_keys(scores, lone, q, weights, softmax_scale, seq, num_causal, index_k, block_table)
    for row in rows[counts > 1].tolist():
        tokens = (seq == row).nonzero().flatten()
        _score_tokens_of_one_row(scores, tokens, row, q, weights, softmax_scale, num_causal, index_k, block_table)
    return scores


def _entry_keys(index_k, block_table, rows, entries, head_dim):
    """index_k at entries of rows (broadcastable index tensors), in fp32."""
    page_size = index_k.shape[1]
    return decode_indexer_keys(index_k[block_table[rows, entries // page_size].long(), entries % page_size], head_dim)


def _score_tokens_with_own_keys(scores, tokens, q, weights, softmax_scale, seq, num_causal, index_k, block_table):
    entries = torch.arange(scores.shape[1], device=q.device)
    for start in range(0, tokens.numel(), _REFERENCE_TILE):
        tile = tokens[start:start + _REFERENCE_TILE]
        valid = entries[None, :] < num_causal[tile, None]  # [t, n]
        keys = _entry_keys(index_k, block_table, seq[tile, None], entries[None, :], q.shape[-1])  # [t, n, d]
        keys = torch.where(valid[..., None], keys, torch.zeros_like(keys))
        dots = torch.relu(torch.einsum("thd,tnd->thn", q[tile].float(), keys)) * softmax_scale
        tile_scores = (dots * weights[tile].float()[..., None]).sum(dim=1)
        scores[tile] = tile_scores.masked_fill(~valid, float("-inf"))


def _score_tokens_of_one_row(scores, tokens, row, q, weights, softmax_scale, num_causal, index_k, block_table):
    num_entries = int(num_causal[tokens].max().item())
    if num_entries == 0:
        return
    entries = torch.arange(num_entries, device=q.device)
    keys = _entry_keys(index_k, block_table, row, entries, q.shape[-1])  # [n, d]: all causal for the row's last token
    tile_size = max(1, 2**22 // (q.shape[1] * num_entries))  # bounds the [t, H, n] products to ~16 MB
    for start in range(0, tokens.numel(), tile_size):
        tile = tokens[start:start + tile_size]
        dots = torch.matmul(q[tile].float(), keys.T).relu_().mul_(softmax_scale)  # [t, H, n]
        tile_scores = torch.bmm(weights[tile].float()[:, None, :], dots)[:, 0]  # sum over heads
        scores[tile, :num_entries] = tile_scores.masked_fill(entries[None, :] >= num_causal[tile, None], float("-inf"))
