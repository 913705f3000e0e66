"""Host memory of a serving process: glibc's malloc settings for steps that run on the CPU, and Python's collector.

A CPU step allocates and frees tensors of hundreds of KB to a few MB in every layer (the attention
reference's gathered keys, the MoE's expert inputs). glibc serves a block above its mmap threshold (128 KB
at first, raised only as such blocks are freed) with a fresh mmap and unmaps it when freed, so the next step
faults every page of it in again, zeroed by the kernel. On the 2-core machine that made prefill steps up to
1.7x slower (bench_prefix.py, a step of 8 prompts of 50-200 tokens: 130-230 ms, 127-135 ms with the
settings below), and it drifted: the threshold rises as a process frees big blocks, so a process's later
runs were faster than its first ones, which skewed benchmarks that compare runs in one process.

`keep_freed_host_memory` raises the mmap threshold to glibc's maximum and the trim threshold far above it, so
freed blocks stay in the heap for the next step. The cost: the process keeps its peak heap (a step's
temporaries), which a server that runs step after step needs again anyway.

Python's cyclic collector: a serving process holds a few hundred thousand objects the collector tracks once its
engine is built (modules, parameters, the pools' and the prefix cache's bookkeeping, the static steps' closures,
Triton's stub), and a full (generation-2) collection walks all of them while its thread holds the GIL: about 100 ms
for the tiny checkpoint's 220,000 on the 2-core machine, during which no step is built or taken in. Decoding keeps
enough new objects (requests' outputs, cache entries) to set one off every few tens of seconds, so every running
request saw a 100 ms gap now and then (`bench_host_overhead.py --churn-seconds`). `freeze_start_up_heap` moves what
is alive when the engine starts serving into the permanent generation (gc.freeze, as vLLM does after its warm-up
and SGLang's freeze_gc): later collections walk only what was allocated since. What it froze is not collected
until `thaw_heap` (the engine's shutdown, so that a process that builds another engine can collect the first).
"""

from __future__ import annotations

import ctypes
import gc
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (4 * 1024 * 1024 * sizeof(long))
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_host_memory() -> bool:
    """Once per process: make glibc keep freed blocks of up to 32 MiB in the heap. False where the C library
    has no mallopt (not glibc) or refuses the settings; nothing changes then."""
    global _done
    if _done:
        return True
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        logger.info("the C library has no mallopt: host allocations keep their default thresholds")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        logger.warning("mallopt refused the host allocation thresholds; CPU steps will fault freed memory back in")
    return _done


def freeze_start_up_heap() -> int:
    """Collect, then exclude every object alive now from later collections; the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (those of an engine shut down become collectable). The whole
    process's: another engine serving in it (a test's, a benchmark's) is walked again from then on."""
    gc.unfreeze()
