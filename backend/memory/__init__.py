"""Paged memory for DeepSeek-V4, and the prefix cache over it.

- `page_allocator`: a free list of page ids (plain ints), all-or-nothing.
- `paged_pool`: the base of the paged pools: tensors, an allocator, page runs.
- `window_pool`: the sliding-window K=V of every layer, paged by position; pages that slide out of
  the window are freed as a request advances.
- `compressed_pool`: compressed entries of CSA layers (plus their indexer keys) and of HCA layers,
  paged by entry index; kept for the request's whole life.
- `compressor_state`: per-request ring buffers of the projections of the last few tokens, from
  which the compressors build each entry when its window closes.
- `kv_manager`: all of the above behind one interface; a request's memory is its `RequestPages`,
  released by `KVCacheManager.free`; the block tables, one row per slot, written as pages are added.
- `prefix_cache`: cached block boundaries and requests' ends: shared pages, ring snapshots, LRU
  eviction.
"""
