"""Decode steps at static shapes, so that a CUDA graph captured once can replay every later step.

A CUDA graph fixes every tensor's shape and address. A decode step's shapes depend on the batch
size, on the context (block-table widths, the indexer's score width) and on how many compressor
windows close this step. Here a decode batch of B rows becomes a batch of `StaticKey`
shapes (built by `build_forward_batch(rows, kv, pad_to=key)`, backend/model/forward_batch.py):
  rows      B padded to the bucket (1, 2, 4, 8, ...): padding rows decode token 0 at position 0 of
            the pools' scratch page / the state pool's scratch slot, which no request owns;
  context   the longest row's end rounded up to a power of two (at least 256): block tables are
            padded with the scratch page to its page count, the indexer scores it in full
            (entries past a token's causal ones are -inf and never picked);
  entries   a decode row closes at most one window per compressor, so every plan has exactly
            `rows` entries; the ones that do not close are padding (`build_plan`'s `num_entries`: entry_row -1,
            stored to the scratch page).
  tokens    speculative decoding's verify rows (`tokens_per_row` = 1 + k, all rows alike) close at most
            ceil((1 + k) / rate) windows each, and keep 1 + k ring positions each;
  snapshots a verify row may cross a prefix-cache block boundary, whose ring state the step writes into a spare
            slot (snapshot keep rows): every plan of a verify key holds the most such rows its rows can need
            (`snapshot_keep_per_row`), the ones no row needs this step written into the scratch slot. (A decode's
            boundary is where it ends: copied after the forward, outside the plan.)
The padded step computes the same outputs for the real rows as the dynamic one
(tests/engine/test_static_batch.py checks it eagerly on CPU); `DecodeGraphs` in
backend/model/graph_runner.py keeps one set of static buffers (and, on CUDA, one graph) per key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_CONTEXT_BUCKET = 256


@dataclass(frozen=True)
class StaticKey:
    rows: int
    context: int  # positions the block tables can address
    tokens_per_row: int = 1  # a decode's 1, or a speculative verify's 1 + k (logits at each)


def row_bucket(num_rows: int) -> int:
    return 1 << max(0, num_rows - 1).bit_length()


def context_bucket(max_end: int) -> int:
    return max(MIN_CONTEXT_BUCKET, 1 << max(0, max_end - 1).bit_length())


def static_key(rows) -> StaticKey:
    """The key of a list of decode BatchRows."""
    return StaticKey(row_bucket(len(rows)), context_bucket(max(r.start_pos + len(r.token_ids) for r in rows)),
                     len(rows[0].token_ids))


def is_decode_batch(rows) -> bool:
    """Rows of one width that want logits at every token: decodes (1 token), or speculative verifies (1 + k tokens,
    prefix-cache snapshots inside them included; backend/speculative.py)."""
    if not rows:
        return False
    width = len(rows[0].token_ids)
    return all(len(r.token_ids) == width and r.want_logits and r.num_logits == width for r in rows)


def entries_per_row(rate: int, tokens_per_row: int) -> int:
    """The most windows of a compressor of `rate` that `tokens_per_row` consecutive positions close."""
    return -(-tokens_per_row // rate)


def snapshot_keep_per_row(rate: int, overlap: bool, tokens_per_row: int, block_tokens: int | None) -> int:
    """The most ring positions that prefix-cache snapshots inside one row of `tokens_per_row` tokens keep, for a
    compressor of `rate` (0 without a prefix cache): a boundary P (a multiple of `block_tokens`) strictly inside the
    row keeps the positions a continuation from P reads of the ring, its open window's P % rate (at most rate -
    gcd(rate, block_tokens)) and with overlap the whole window before (compressor._snapshot_lookback)."""
    if block_tokens is None or tokens_per_row < 2:
        return 0
    boundaries = -(-(tokens_per_row - 1) // block_tokens)
    return boundaries * (rate - math.gcd(rate, block_tokens) + (rate if overlap else 0))
