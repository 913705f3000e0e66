"""Helpers shared by the kernel host wrappers."""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

DEFAULT_NUM_SMS = 132  # H100 / H200; used off a CUDA device (interpreter, compile check)
# One sm_90 streaming multiprocessor: what bounds the programs resident at once.
SM90_REGISTERS = 65536
SM90_THREADS = 2048
SM90_SHARED = 228 * 1024  # bytes; each resident program also reserves 1 KB
SM90_PROGRAMS = 32
REGISTER_GRANULE = 256  # registers are allocated per warp in units of 256


def is_interpreting() -> bool:
    """Whether @triton.jit kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # torch -> tl


def compute_dtype(dtype: torch.dtype):
    """tl dtype fed to tl.dot: the storage dtype on a GPU; fp32 for bf16 under the interpreter,
    whose bf16 arithmetic is wrong (bf16 values are raw bits there; only casts work)."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and is_interpreting()):
        return tl.float32
    return TL_DTYPES[dtype]


LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")  # a tile configuration's compile options (the rest: tiles)


def launch_options(config: dict) -> dict:
    """The compile options of a tile configuration (maxnreg where it caps ptxas's register choice)."""
    return {k: config[k] for k in LAUNCH_OPTIONS if k in config}


def row_alignment(*strides: int, cap: int = 16) -> int:
    """The largest power of two, up to cap, dividing every stride: what rows of a pool at those strides are known
    to start at a multiple of (a kernel's tl.multiple_of hint: wide loads)."""
    alignment = cap
    for stride in strides:
        while stride % alignment:
            alignment //= 2
    return alignment


def aligned_words(t: torch.Tensor) -> bool:
    """Whether a kernel may read t's bytes as 4-byte words: on a GPU its start must be 4-byte aligned (device
    allocations are); on the CPU, where Triton's interpreter runs, any start does (weights read from a safetensors
    file's mapping start at any byte)."""
    return t.device.type == "cpu" or t.data_ptr() % 4 == 0


@lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_per_program(num_rows: int, other_tiles: int, largest: int, device: torch.device, smallest: int = 16) -> int:
    """Weight rows a swap-AB GEMM program takes (a power of two from `largest` down to `smallest`): halved while the
    grid, cdiv(num_rows, rows) times the `other_tiles` along the tokens, gives fewer programs than the device has SMs
    (a decode step's narrow weights, whose programs would otherwise leave SMs idle)."""
    rows = largest
    while rows > smallest and triton.cdiv(num_rows, rows) * other_tiles < num_sms(device):
        rows //= 2
    return rows


def programs_per_sm(registers_per_thread: int, num_warps: int, shared_bytes: int) -> int:
    """Programs (CTAs) of one kernel resident on an sm_90 SM at once: the least of what its registers, threads and
    shared memory allow (at least 1)."""
    per_warp = -(-registers_per_thread * 32 // REGISTER_GRANULE) * REGISTER_GRANULE
    by_registers = SM90_REGISTERS // (per_warp * num_warps)
    by_threads = SM90_THREADS // (32 * num_warps)
    by_shared = SM90_SHARED // (shared_bytes + 1024)
    return max(1, min(by_registers, by_threads, by_shared, SM90_PROGRAMS))


_OCCUPANCY: dict[tuple, int] = {}


def compiled_programs_per_sm(kernel, make_args, kwargs, device: torch.device, key: tuple,
                             assumed_registers: int) -> int:
    """`programs_per_sm` of `kernel` as compiled for the arguments make_args() returns: on CUDA its real register
    and shared-memory use (compiled once through JITFunction.warmup, cached under `key`); elsewhere (the
    interpreter, meta tensors) `assumed_registers` per thread and no shared memory. On CUDA the compile happens at
    the first step of a shape, before any CUDA graph capture (graph_runner warms up first)."""
    if key in _OCCUPANCY:
        return _OCCUPANCY[key]
    num_warps = kwargs.get("num_warps", 4)
    registers, shared = assumed_registers, 0
    if device.type == "cuda" and not is_interpreting():
        compiled = kernel.warmup(*make_args(), grid=(1,), **kwargs)
        compiled._init_handles()  # loads the module: sets n_regs
        registers, shared = compiled.n_regs, compiled.metadata.shared
    _OCCUPANCY[key] = programs_per_sm(registers, num_warps, shared)
    return _OCCUPANCY[key]


SPLIT_COUNTERS = 64  # per stream: the tiles of a launch whose programs split a reduction (kernels/mhc.py, fp8_gemm.py)
_COUNTERS: dict[tuple, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """Int32 counters, zeroed once, for kernels whose last program to finish a tile reduces the others' partial sums:
    each launch leaves the counters it used at zero again (no memset: a CUDA graph can replay it). A set per device
    and CUDA stream: launches on one stream run in order, while two streams' (a layer's side stream beside its main
    one: the indexer's q GEMM beside q_b's) would bump the same tiles' counters at once."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (str(device), stream)
    if key not in _COUNTERS:
        # (made in a capture, they would be the graph's memory, zeroed only when it first replays: whatever ran
        # before that would read what the memory held)
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), \
            "split counters are made before a CUDA graph capture (graph_runner.CapturedGraph)"
        _COUNTERS[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


@triton.jit
def clamped_swiglu_values(gate, up, limit):
    """silu(min(g, limit)) * clamp(u, +-limit) in fp32 from the gate and up values: the shared expert's activation
    (kernels/moe.py's swiglu kernel, and the FP8 GEMM that computes it as it loads its input)."""
    gate = tl.minimum(gate.to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up.to(tl.float32), -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def last_to_arrive(counter_ptr, index, arrivals):
    """Whether this program is the last of `arrivals` to bump counter `index` (a split_counters entry), once its
    partial sums are stored: a barrier orders all of its stores before its one thread's acq_rel bump, so the last
    sees every other's; the last sets the counter back to zero."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr + index, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = done == arrivals - 1
    if last:
        tl.store(counter_ptr + index, 0)
    return last


# --- launches ---------------------------------------------------------------------------------------------------------
# Programmatic dependent launch (Hopper on): a kernel may be started while the one before it in the stream still runs,
# its programs resident and waiting at `griddepcontrol.wait` until that one has finished and its writes are visible,
# rather than launched after it ends: the launch and the programs' start overlap the kernel before (a decode step at
# batch 1 is some 800 short kernels). Every kernel here waits first, before it reads or writes anything, and then lets
# the kernel after it start; a kernel after a torch operator, which never lets it start early, starts when that one
# ends, as without. The engine's `programmatic_dependent_launch` turns it on for the process
# (`set_programmatic_dependent_launch`).
#
# While it waits, a kernel that streams a weight (the FP8 GEMMs, the grouped o_a, the fp32 linears) asks L2 for the
# first lines of its weight rows (`prefetch_weight_rows`): weights are never written by a kernel, so they may be read
# early, and a decode step's weight reads are what it waits on. Only a hint: nothing reaches a register before the
# wait. PREFETCH_BYTES a program (its rows' first lines): over one program an SM, about 2 microseconds of an H200's
# copy bandwidth (4.27 TB/s), the order of a kernel's launch and ramp-up.
_PDL = {"on": False, "prefetch": True}
PREFETCH_BYTES = 64 * 1024
PREFETCH_LINE = 128  # bytes: an L2 line


def set_programmatic_dependent_launch(on: bool, prefetch_weights: bool = True) -> None:
    """Launch this process's kernels with programmatic dependent launch (a CUDA device of compute capability 9.0 or
    more) or without; with it, the weight-streaming kernels prefetch their first weight lines while they wait, unless
    `prefetch_weights` is False (what the prefetch adds is timed by bench_v4's `pdl+no_prefetch`)."""
    _PDL["on"], _PDL["prefetch"] = on, prefetch_weights


def programmatic_dependent_launch() -> bool:
    return _PDL["on"]


def weight_prefetch_lines(rows: int, row_bytes: int) -> int:
    """PREFETCH_LINES of a program that streams `rows` weight rows of `row_bytes` bytes each (its share of K): how
    many 128-byte lines of each row it asks L2 for while it waits for the kernel before it, a power of two within
    PREFETCH_BYTES a program; 0 unless kernels are launched with programmatic dependent launch and weight prefetch."""
    if not (_PDL["on"] and _PDL["prefetch"]) or rows <= 0 or row_bytes <= 0:
        return 0
    lines = min(triton.cdiv(row_bytes, PREFETCH_LINE), max(1, PREFETCH_BYTES // (PREFETCH_LINE * rows)))
    return 1 << (lines.bit_length() - 1)


def launch(launches) -> None:
    """Run a plan's launches [(kernel, grid, args, kwargs)], with programmatic dependent launch where it is on."""
    pdl = dict(PDL=True, launch_pdl=True) if _PDL["on"] else {}
    for kernel, grid, args, kwargs in launches:
        kernel[grid](*args, **kwargs, **pdl)


@triton.jit
def prefetch_weight_rows(PDL: tl.constexpr, w_ptr, rows, num_rows, stride, start, end, LINES: tl.constexpr):
    """Launched with programmatic dependent launch, before `wait_for_previous_kernel`: ask L2 for LINES lines of each
    weight row in `rows` (clamped to the weight's num_rows) from element `start` (each address clamped below the
    row's `end`: every one in the weight). `prefetch.global.L2`: no register is loaded, nothing is written. A no-op
    otherwise, and with LINES 0 (`weight_prefetch_lines`)."""
    if PDL and LINES > 0:
        PER_LINE: tl.constexpr = 8 * 128 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements a 128-byte line
        columns = tl.minimum(start + tl.arange(0, LINES) * PER_LINE, end - 1)
        row = tl.minimum(rows, num_rows - 1).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [w_ptr + row[:, None] * stride + columns[None, :]], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Every kernel's first statement: launched with programmatic dependent launch (PDL), wait until the kernel before
    it has finished, then let the one after it start (the one after waits in the same way, so that nothing it does can
    overtake this one's reads or writes). A no-op otherwise."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
