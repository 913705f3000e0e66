"""Paged memory for DeepSeek-V4, one module per pool kind.

- `window_pool`: the sliding-window K=V of every layer, paged by position; pages that slide out of
  the window are freed as a request advances.
- `compressed_pool`: compressed entries of CSA layers (plus their indexer keys) and of HCA layers,
  paged by entry index; kept for the request's whole life.
- `compressor_state`: per-request ring buffers of the projections of the last few tokens, from
  which the compressors build each entry when its window closes.
"""
