#!/usr/bin/env python
"""Check the Triton kernels against their references, then time them at DeepSeek-V4-Flash's shapes.

For a machine with an NVIDIA GPU (installs nothing). Cases:
  attention   decode batches 1, 8, 32, 64, 128, 256 at ~8K context and one 4096-token prefill chunk, for sliding
              (window only), CSA (window + top-512) and HCA (window + all 1/128 entries) layers
  indexer     the same decode batches and prefill chunk (CSA, 64 heads x 128)
  moe         256 experts top-6, hidden 4096, intermediate 2048, at 1..256 decode tokens and 4096 prefill tokens
  moe_q       the same MoE cases with the experts as published (fp8 with block scales, mxfp4 repacked for the
              kernels once, outside the timing), in transformers' numerics (bf16 activations) and in DeepSeek's
              ("deepseek": its order, x and h act_quant'ed: fp8 runs e4m3 x e4m3); "ref" is the bf16 kernel on the
              dequantized weights, so "x ref" is the speed-up of serving them quantized
  fp8_gemm    the FP8 linears of V4-Flash (wq_a, wq_b, wkv, wo_a, wo_b, shared experts) at 1, 16, 32, 64 and 4096
              tokens (each variant fp8_gemm_config picks), checked against fp8_gemm_reference; "ref" is the same
              product as a bf16 F.linear (cuBLAS) on the dequantized weight, so "x ref" is the FP8 kernel's
              speed-up over serving the weight in bf16; and "wq_b+rms_norm", "shared w2+swiglu": the GEMMs that
              compute their input (q_a's RMSNorm, the shared expert's SwiGLU) as they load it, against the
              norm_rope / swiglu launch and the plain GEMM they replace
  fp32_linear DeepSeek's fp32 LM head and router over bf16 weights at the decode batches, against the torch
              expression F.linear(x.float(), w.float()) they replace
  grouped_linear  the output projection's o_a_proj (8 groups of 1,024 rows) kept FP8, at the fp8_gemm token counts,
              against the bf16 batched matmul over the dequantized weight
  mhc         the hyper-connection collapse (+ RMSNorm), mix (+ a second, fp32 block output) and head collapse on
              bf16 streams [T, 4, 4096] at the decode batches and the prefill chunk
  glue        the rest of a layer's launches at the decode batches and the prefill chunk: RMSNorm+RoPE (q_a; q per
              head; K=V stored into the window pool), routing (top-k, hash), the MoE alignment, the shared expert's
              SwiGLU, and the three compressors (CSA, HCA, indexer keys) with every decode row closing an entry,
              and a CSA layer's two in one launch ("ref" there: their two launches)
Each case is timed with CUDA events (median of --repeat runs, L2 flushed before each) and reported as achieved
bandwidth (bytes the kernel must move) and TFLOP/s, against the device's measured copy bandwidth (a large
device-to-device copy) and bf16 matmul rate (a large torch.matmul), with the reference's time and the speed-up.

  python scripts/bench_kernels.py [--kernels attention,indexer,moe,fp8_gemm,fp32_linear] [--json FILE] [--csv FILE]
  python scripts/bench_kernels.py --dry-run   # CPU: small shapes, kernels under TRITON_INTERPRET, references
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench_results import write_csv  # noqa: E402


@dataclass
class Shapes:
    """Model and benchmark sizes; FULL is DeepSeek-V4-Flash, DRY a CPU-sized stand-in for --dry-run."""
    head_dim: int
    num_heads: int
    index_head_dim: int
    index_heads: int
    index_topk: int
    hidden: int
    moe_inter: int
    num_experts: int
    top_k: int
    window: int
    csa_rate: int
    hca_rate: int
    page_size: int
    context: int
    decode_batches: list = field(default_factory=list)
    prefill_tokens: int = 0
    moe_decode_tokens: list = field(default_factory=list)
    fp8_linears: dict = field(default_factory=dict)  # name -> (N, K)
    fp8_tokens: list = field(default_factory=list)
    q_lora_rank: int = 0
    rope_dim: int = 0
    vocab: int = 0
    o_groups: int = 1
    o_lora_rank: int = 128


FULL = Shapes(head_dim=512, num_heads=64, index_head_dim=128, index_heads=64, index_topk=512, hidden=4096,
              moe_inter=2048, num_experts=256, top_k=6, window=128, csa_rate=4, hca_rate=128, page_size=64,
              context=8192, decode_batches=[1, 8, 32, 64, 128, 256], prefill_tokens=4096,
              moe_decode_tokens=[1, 8, 32, 64, 128, 256],
              fp8_linears={"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_a": (8192, 4096),
                           "wo_b": (4096, 8192), "shared w1": (2048, 4096), "shared w2": (4096, 2048)},
              fp8_tokens=[1, 16, 32, 64, 4096], q_lora_rank=1024, rope_dim=64, vocab=129280,
              o_groups=8, o_lora_rank=1024)
DRY = Shapes(head_dim=64, num_heads=4, index_head_dim=32, index_heads=16, index_topk=8, hidden=64, moe_inter=32,
             num_experts=8, top_k=2, window=16, csa_rate=4, hca_rate=16, page_size=8, context=72,
             decode_batches=[1, 3], prefill_tokens=24, moe_decode_tokens=[1, 5],
             fp8_linears={"irregular": (200, 300)}, fp8_tokens=[1, 5, 20], q_lora_rank=48, rope_dim=16, vocab=1000,
             o_groups=2, o_lora_rank=64)


@dataclass
class Result:
    kernel: str
    case: str
    ms: float | None
    reference_ms: float | None
    gbytes: float
    gflop: float
    max_error: float  # normalised: max |kernel - reference| / (atol + rtol |reference|), <= 1 passes

    def derived(self, copy_gbps: float | None, matmul_tflops: float | None) -> dict:
        row = asdict(self)
        if self.ms:
            row["gbps"] = self.gbytes / (self.ms * 1e-3)
            row["tflops"] = self.gflop / (self.ms * 1e-3) / 1e3
            row["pct_copy_bw"] = 100 * row["gbps"] / copy_gbps if copy_gbps else None
            row["pct_matmul"] = 100 * row["tflops"] / matmul_tflops if matmul_tflops else None
            row["speedup"] = self.reference_ms / self.ms if self.reference_ms else None
        return row


# --- timing ---------------------------------------------------------------------------------------------------
HOST_COVER_CYCLES = 2_000_000  # about 1 ms of a GPU's clock (H200: 1.98 GHz)


class Timer:
    """Median time of fn() in ms: CUDA events with an L2 flush before each run, or perf_counter on CPU.

    On CUDA the GPU is kept busy (torch.cuda._sleep, after the flush) while the host records the start event and fn
    plans and launches its kernels: the start is then timestamped when the GPU reaches it, with fn's kernels queued
    behind it, so the host's planning (Python, tens to hundreds of microseconds) is not timed as a ~10 us kernel's."""

    def __init__(self, torch, device, repeat: int):
        self.torch, self.device, self.repeat = torch, device, repeat
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        torch = self.torch
        fn()  # warm-up (and compilation)
        times = []
        for _ in range(self.repeat):
            if self.flush is not None:
                self.flush.zero_()
                if hasattr(torch.cuda, "_sleep"):
                    torch.cuda._sleep(HOST_COVER_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def measure_device(torch, device, timer: Timer) -> tuple[float | None, float | None]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s) measured on this device; (None, None) on CPU."""
    if device.type != "cuda":
        return None, None
    return copy_bandwidth(torch, device, timer, 2 * 2**30), matmul_rate(torch, device, timer, 8192, torch.bfloat16)


def copy_bandwidth(torch, device, timer: Timer, num_bytes: int) -> float:
    """GB/s of a device-to-device copy of `num_bytes`, counting read + write: what a memory-bound kernel can reach."""
    src = torch.empty(num_bytes, dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    return 2 * num_bytes / (timer(lambda: dst.copy_(src)) * 1e-3) / 1e9


def matmul_rate(torch, device, timer: Timer, n: int, dtype) -> float:
    """TFLOP/s of an [n, n] x [n, n] torch.matmul in `dtype`."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / (timer(lambda: torch.matmul(a, b)) * 1e-3) / 1e12


# --- inputs -----------------------------------------------------------------------------------------------------
def _paged(torch, gen, device, spans, page_size, width, dtype):
    """Pool [pages, page_size, width] holding, per sequence, entries [first_page * page_size, end) on shuffled pages,
    and its block table [B, C] int32 (column c = logical page first_page + c). spans: (first_page, end) per row."""
    counts = [max(1, -(-end // page_size) - first) for first, end in spans]
    pool = torch.randn(sum(counts), page_size, width, generator=gen, device=device).to(dtype)
    order = torch.randperm(sum(counts), generator=gen, device=device).to(torch.int32)
    table = torch.zeros(len(spans), max(counts), dtype=torch.int32, device=device)
    start = 0
    for row, count in enumerate(counts):
        table[row, :count] = order[start : start + count]
        start += count
    return pool, table


def attention_inputs(torch, s: Shapes, device, positions: list[list[int]], mode: str, seed=0):
    """Arguments of sparse_paged_attention for sequences whose query positions are `positions[b]`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16
    token_seq = torch.tensor([b for b, ps in enumerate(positions) for _ in ps], dtype=torch.int32, device=device)
    token_pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.int64, device=device)
    first_page = [max(0, min(ps) - s.window + 1) // s.page_size for ps in positions]
    window_kv, window_table = _paged(torch, gen, device, [(f, max(ps) + 1) for f, ps in zip(first_page, positions)],
                                     s.page_size, s.head_dim, dtype)
    kwargs = dict(token_seq=token_seq, token_pos=token_pos, window_kv=window_kv, window_block_table=window_table,
                  window_first_page=torch.tensor(first_page, dtype=torch.int64, device=device), window=s.window)
    if mode != "window":
        rate = s.csa_rate if mode == "csa" else s.hca_rate
        entries = [(max(ps) + 1) // rate for ps in positions]
        comp_kv, comp_table = _paged(torch, gen, device, [(0, n) for n in entries], s.page_size, s.head_dim, dtype)
        kwargs.update(comp_kv=comp_kv, comp_block_table=comp_table, compress_rate=rate)
        if mode == "csa":
            causal = (token_pos + 1) // rate
            scores = torch.rand(token_pos.numel(), max(max(entries), s.index_topk), generator=gen, device=device)
            scores[torch.arange(scores.shape[1], device=device)[None, :] >= causal[:, None]] = -1.0
            topk = scores.topk(s.index_topk, dim=-1)
            kwargs["topk_indices"] = torch.where(topk.values >= 0, topk.indices, -1).to(torch.int32)
    q = torch.randn(token_pos.numel(), s.num_heads, s.head_dim, generator=gen, device=device).to(dtype)
    sinks = torch.randn(s.num_heads, generator=gen, device=device)
    # as the model calls it: the kernel norms and ropes q and rotates the output back
    angles = torch.rand(token_pos.numel(), s.rope_dim // 2, generator=gen, device=device) * 6
    kwargs.update(q_norm_eps=1e-6, rope=(angles.cos().to(dtype), angles.sin().to(dtype)))
    return (q, sinks, s.head_dim**-0.5), kwargs


def indexer_inputs(torch, s: Shapes, device, positions: list[list[int]], seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16
    token_seq = torch.tensor([b for b, ps in enumerate(positions) for _ in ps], dtype=torch.int32, device=device)
    token_pos = torch.tensor([p for ps in positions for p in ps], dtype=torch.int64, device=device)
    index_k, table = _paged(torch, gen, device, [(0, (max(ps) + 1) // s.csa_rate) for ps in positions],
                            s.page_size, s.index_head_dim, dtype)
    q = torch.randn(token_pos.numel(), s.index_heads, s.index_head_dim, generator=gen, device=device).to(dtype)
    weights = torch.randn(token_pos.numel(), s.index_heads, generator=gen, device=device) * s.index_heads**-0.5
    return (q, weights, s.index_head_dim**-0.5, token_seq, token_pos, index_k, table, s.csa_rate)


def moe_weights(torch, s: Shapes, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w_gate_up = torch.empty(s.num_experts, 2 * s.moe_inter, s.hidden, dtype=torch.bfloat16, device=device)
    w_down = torch.empty(s.num_experts, s.hidden, s.moe_inter, dtype=torch.bfloat16, device=device)
    for e in range(s.num_experts):  # one expert at a time: no fp32 copy of all the weights
        w_gate_up[e] = torch.randn(2 * s.moe_inter, s.hidden, generator=gen, device=device) * s.hidden**-0.5
        w_down[e] = torch.randn(s.hidden, s.moe_inter, generator=gen, device=device) * s.moe_inter**-0.5
    return w_gate_up, w_down


def moe_inputs(torch, s: Shapes, device, num_tokens: int, weights, seed=0):
    from kernels.moe import route_topk

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(num_tokens, s.hidden, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(num_tokens, s.num_experts, generator=gen, device=device)
    topk_ids, topk_weights = route_topk(logits, torch.zeros(s.num_experts, device=device), s.top_k, 2.5)
    return (x, topk_ids, topk_weights, *weights, 10.0)


def decode_positions(s: Shapes, batch: int) -> list[list[int]]:
    """One query per sequence at ~context, ragged (each a little shorter)."""
    return [[s.context - 1 - (b * 37) % max(1, s.context // 16)] for b in range(batch)]


def prefill_positions(s: Shapes) -> list[list[int]]:
    """One chunk of prefill_tokens ending at the context (so it has history before it)."""
    return [list(range(s.context - s.prefill_tokens, s.context))]


# --- traffic and work models ------------------------------------------------------------------------------------
def attention_work(s: Shapes, positions, mode: str, key_bytes: float | None = None) -> tuple[float, float]:
    """(GB, GFLOP): every key each token attends to read once (key_bytes each: bf16 by default, or the fp8 layout's
    entry), q and out (bf16); 4 * H * D flops per key."""
    keys = 0
    for ps in positions:
        for p in ps:
            keys += min(s.window, p + 1)
            if mode == "csa":
                keys += min(s.index_topk, (p + 1) // s.csa_rate)
            elif mode == "hca":
                keys += (p + 1) // s.hca_rate
    tokens = sum(len(ps) for ps in positions)
    unique_keys = keys if tokens == len(positions) else _prefill_unique_keys(s, positions, mode)
    key_bytes = 2 * s.head_dim if key_bytes is None else key_bytes
    gbytes = (unique_keys * key_bytes + 2 * tokens * s.num_heads * s.head_dim * 2) / 1e9
    return gbytes, 4 * s.num_heads * s.head_dim * keys / 1e9


def _prefill_unique_keys(s: Shapes, positions, mode):
    """A chunk's tokens share window and compressed keys: count distinct ones."""
    lo, hi = min(min(ps) for ps in positions), max(max(ps) for ps in positions)
    keys = hi - max(0, lo - s.window + 1) + 1
    if mode == "csa":
        keys += (hi + 1) // s.csa_rate
    elif mode == "hca":
        keys += (hi + 1) // s.hca_rate
    return keys


def indexer_work(s: Shapes, positions, key_bytes: float | None = None) -> tuple[float, float]:
    entries = [(p + 1) // s.csa_rate for ps in positions for p in ps]
    distinct = sum(max((p + 1) // s.csa_rate for p in ps) for ps in positions)
    tokens = len(entries)
    key_bytes = 2 * s.index_head_dim if key_bytes is None else key_bytes
    gbytes = (distinct * key_bytes + tokens * s.index_heads * (s.index_head_dim * 2 + 4)
              + sum(entries) * 4) / 1e9
    return gbytes, 2 * s.index_heads * s.index_head_dim * sum(entries) / 1e9


def moe_work(s: Shapes, topk_ids, weight_bytes: float = 2.0) -> tuple[float, float]:
    """(GB, GFLOP): weights of every expert used (weight_bytes per weight), x in, out; 6 * I * D flops per pair."""
    used = int(topk_ids.unique().numel())
    pairs = topk_ids.numel()
    gbytes = (used * 3 * s.moe_inter * s.hidden * weight_bytes + 2 * topk_ids.shape[0] * s.hidden * 2) / 1e9
    return gbytes, 6 * pairs * s.moe_inter * s.hidden / 1e9


# --- running ----------------------------------------------------------------------------------------------------
# (atol, rtol) of the check; bf16 outputs carry about 2^-8 relative rounding.
TOLERANCES = {"attention": (2e-2, 2e-2), "attn_fp8": (2e-2, 2e-2), "indexer": (1e-3, 1e-3), "idx_fp4": (1e-3, 1e-3),
              "moe": (3e-2, 3e-2), "moe_q": (3e-2, 3e-2),
              "fp8_gemm": (2e-2, 2e-2), "mhc": (3e-2, 3e-2), "glue": (3e-2, 3e-2), "fp32_linear": (1e-4, 1e-5),
              "grouped": (2e-2, 2e-2),
              # bf16 entries against the fp32 reference: gate + bias, softmax weights, pooled sum, RMSNorm and RoPE
              # each round once in the kernel (tests/kernels/test_compressor.py's bf16 tolerance; an H200 reached
              # 1.13 of the glue tolerance)
              "compress": (4e-2, 2e-2)}


def _max_error(torch, actual, expected, atol, rtol) -> float:
    """max |actual - expected| / (atol + rtol |expected|) over finite entries: <= 1 passes; inf where the
    -inf / finite pattern differs."""
    finite = expected.isfinite()
    if not torch.equal(finite, actual.isfinite()):
        return float("inf")
    if not finite.any():
        return 0.0
    a, e = actual.float()[finite], expected.float()[finite]
    return ((a - e).abs() / (atol + rtol * e.abs())).max().item()


def run_case(torch, timer, kernel, case, triton_fn, reference_fn, args, kwargs, work, options,
             float_reference=True):
    """Check triton_fn against reference_fn (on fp32 copies of bf16 inputs if float_reference), then time both."""
    if float_reference:
        expected_fn = lambda: reference_fn(*_to_float(torch, args), **_to_float(torch, kwargs))  # noqa: E731
    else:
        expected_fn = lambda: reference_fn(*args, **kwargs)  # noqa: E731
    return check_and_time(torch, timer, kernel, case, lambda: triton_fn(*args, **kwargs),
                          lambda: reference_fn(*args, **kwargs), expected_fn, work, options)


def check_and_time(torch, timer, kernel, case, kernel_fn, reference_fn, expected_fn, work, options,
                   tolerance: str | None = None) -> "Result":
    """Compare kernel_fn() with expected_fn() (a tensor, or a tuple of them compared pairwise) within
    TOLERANCES[tolerance or kernel], then time kernel_fn and reference_fn; work = (GB moved, GFLOP). Prints one line."""
    actual, expected = kernel_fn(), expected_fn()
    pairs = zip(actual, expected) if isinstance(actual, tuple) else [(actual, expected)]
    error = max(_max_error(torch, a, e, *TOLERANCES[tolerance or kernel]) for a, e in pairs)
    del actual, expected, pairs
    status = "ok" if error <= 1 else f"MISMATCH (normalised error {error:.3g} > 1)"
    ms = timer(kernel_fn)
    ref_ms = None if options.skip_reference else timer(reference_fn)
    print(f"  {kernel:<10} {case:<24} {ms:9.3f} ms  ref {ref_ms or float('nan'):9.3f} ms  {status}", flush=True)
    return Result(kernel, case, ms, ref_ms, *work, error)


def _to_float(torch, values):
    convert = lambda v: v.float() if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v  # noqa: E731
    if isinstance(values, dict):
        return {k: convert(v) for k, v in values.items()}
    return [convert(v) for v in values]


def attention_cases(s: Shapes):
    """(mode, case name, query positions per sequence): decode batches and a prefill chunk for each layer kind."""
    for mode in ("window", "csa", "hca"):
        for b in s.decode_batches:
            yield mode, f"{mode} decode B={b}", decode_positions(s, b)
        yield mode, f"{mode} prefill T={s.prefill_tokens}", prefill_positions(s)


def bench_attention(torch, s, device, timer, options):
    from kernels.attention import sparse_paged_attention_reference, sparse_paged_attention_triton

    results = []
    for mode, name, positions in attention_cases(s):
        args, kwargs = attention_inputs(torch, s, device, positions, mode)
        results.append(run_case(torch, timer, "attention", name, sparse_paged_attention_triton,
                                sparse_paged_attention_reference, args, kwargs,
                                attention_work(s, positions, mode), options))
        del args, kwargs
    return results


def indexer_cases(s: Shapes):
    """(case name, query positions per sequence): the decode batches and the prefill chunk."""
    yield from ((f"decode B={b}", decode_positions(s, b)) for b in s.decode_batches)
    yield f"prefill T={s.prefill_tokens}", prefill_positions(s)


def bench_indexer(torch, s, device, timer, options):
    from kernels.indexer import indexer_scores_reference, indexer_scores_triton

    results = []
    for name, positions in indexer_cases(s):
        args = indexer_inputs(torch, s, device, positions)
        results.append(run_case(torch, timer, "indexer", name, indexer_scores_triton, indexer_scores_reference,
                                args, {}, indexer_work(s, positions), options))
    return results


def bench_moe(torch, s, device, timer, options):
    from kernels.moe import fused_moe_reference, fused_moe_triton

    weights = moe_weights(torch, s, device)
    results = []
    for num_tokens in [*s.moe_decode_tokens, s.prefill_tokens]:
        args = moe_inputs(torch, s, device, num_tokens, weights)
        name = f"{'prefill' if num_tokens == s.prefill_tokens else 'decode'} T={num_tokens}"
        # the reference on the bf16 inputs: an fp32 copy of all the weights would take 26 GB
        results.append(run_case(torch, timer, "moe", name, fused_moe_triton, fused_moe_reference, args, {},
                                moe_work(s, args[1]), options, float_reference=False))
    return results


def fp8_linear_weight(torch, device, n: int, k: int, gen):
    """(e4m3 weight [N, K], float32 128x128 block scales) of a random FP8 linear as published."""
    w_q = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_scale = torch.exp2(torch.randint(-14, -10, (-(-n // 128), -(-k // 128)), generator=gen, device=device).float())
    return w_q, w_scale


def bench_fp8_gemm(torch, s, device, timer, options):
    import torch.nn.functional as F

    from kernels.fp8_gemm import fp8_gemm_reference, fp8_gemm_triton

    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in s.fp8_linears.items():
        w_q, w_scale = fp8_linear_weight(torch, device, n, k, gen)
        w_bf16 = fp8_gemm_reference(torch.eye(k, device=device), w_q, w_scale).T.contiguous().to(torch.bfloat16)
        for t in s.fp8_tokens:
            x = torch.randn(t, k, generator=gen, device=device).to(torch.bfloat16)
            actual, expected = fp8_gemm_triton(x, w_q, w_scale), fp8_gemm_reference(x.float(), w_q, w_scale)
            error = _max_error(torch, actual, expected, *TOLERANCES["fp8_gemm"])
            ms = timer(lambda: fp8_gemm_triton(x, w_q, w_scale))
            ref_ms = None if options.skip_reference else timer(lambda: F.linear(x, w_bf16))
            work = ((n * k + w_scale.numel() * 4 + 2 * t * (k + n)) / 1e9, 2 * t * n * k / 1e9)
            status = "ok" if error <= 1 else f"MISMATCH (normalised error {error:.3g} > 1)"
            print(f"  {'fp8_gemm':<10} {name + f' T={t}':<24} {ms:9.3f} ms  bf16 {ref_ms or float('nan'):9.3f} ms  "
                  f"{status}", flush=True)
            results.append(Result("fp8_gemm", f"{name} T={t}", ms, ref_ms, *work, error))
    return results + _fp8_prologue_cases(torch, s, device, timer, options, gen)


# The FP8 GEMMs of V4-Flash that compute their input as they load it (kernels/fp8_gemm.py's PROLOGUE: "rms_norm",
# "swiglu") and their output as they store it ("head_rope": the indexer's queries roped and rounded)
FP8_FUSIONS = {"wq_b": ("rms_norm",), "index wq_b": ("rms_norm+head_rope",), "shared w2": ("swiglu",),
               "irregular": ("rms_norm", "swiglu")}


def _fp8_prologue_cases(torch, s, device, timer, options, gen):
    """Each fused GEMM against the launches it replaces (the norm or SwiGLU kernel, the GEMM, the norm_rope kernel)."""
    from kernels.fp8_gemm import fp8_gemm_triton
    from kernels.moe import swiglu_triton
    from kernels.norm_rope import norm_rope_triton

    results = []
    index_q_b = (s.index_heads * s.index_head_dim, s.q_lora_rank)  # (its plain GEMM: timed within `separate`)
    for name, (n, k) in {**s.fp8_linears, "index wq_b": index_q_b}.items():
        w_q, w_scale = fp8_linear_weight(torch, device, n, k, gen)
        norm = ((torch.rand(k, generator=gen, device=device) + 0.5).to(torch.bfloat16), 1e-6)
        for fusion in FP8_FUSIONS.get(name, ()):
            swiglu, head_rope = "swiglu" in fusion, "head_rope" in fusion
            prologue = dict(swiglu_limit=10.0) if swiglu else dict(rms_norm=norm) if "rms_norm" in fusion else {}
            for t in s.fp8_tokens:
                x = (torch.randn(t, 2 * k if swiglu else k, generator=gen, device=device) * 3).to(torch.bfloat16)
                angles = torch.randn(t, s.rope_dim // 2, generator=gen, device=device) * 3
                cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
                epilogue = dict(rope=(cos, sin, s.index_head_dim), round_indexer=True) if head_rope else {}

                def separate():
                    gemm_input = (swiglu_triton(x, 10.0) if swiglu else norm_rope_triton(x, *norm) if prologue
                                  else x)
                    out = fp8_gemm_triton(gemm_input, w_q, w_scale)
                    if head_rope:
                        out = norm_rope_triton(out.view(t, -1, s.index_head_dim), normalize=False, cos=cos, sin=sin,
                                               round_indexer=True)
                    return out.view(t, n)

                work = ((n * k + w_scale.numel() * 4 + 2 * t * (x.shape[1] + n)) / 1e9, 2 * t * n * k / 1e9)
                # checked against the launches it replaces (each checked against its reference in its own case):
                # a torch sigmoid or rsqrt an ulp off moves an e4m3 rounding of the GEMM's input
                results.append(check_and_time(torch, timer, "fp8_gemm", f"{name}+{fusion} T={t}",
                                              lambda: fp8_gemm_triton(x, w_q, w_scale, **prologue, **epilogue),
                                              separate, separate, work, options))
    return results


def bench_fp32_linear(torch, s, device, timer, options):
    """DeepSeek's fp32 router and LM head over bf16 weights against what they replace, F.linear(x.float(),
    w.float()): the kernel reads the weight once, the torch expression copies it to fp32 first."""
    from kernels.fp32_linear import fp32_linear_reference, fp32_linear_triton

    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, n in (("lm head", s.vocab), ("router", s.num_experts)):
        weight = (torch.randn(n, s.hidden, generator=gen, device=device) * s.hidden ** -0.5).to(torch.bfloat16)
        for t in s.decode_batches:
            x = torch.randn(t, s.hidden, generator=gen, device=device)
            work = ((2 * n * s.hidden + 4 * t * (s.hidden + n)) / 1e9, 2 * t * n * s.hidden / 1e9)
            results.append(check_and_time(torch, timer, "fp32_linear", f"{name} T={t}",
                                          lambda: fp32_linear_triton(x, weight),
                                          lambda: fp32_linear_reference(x, weight),
                                          lambda: fp32_linear_reference(x.double(), weight.double()).float(), work,
                                          options))
    return results


def bench_grouped_linear(torch, s, device, timer, options):
    """The attention output's o_a_proj kept FP8 against the bf16 batched matmul over its dequantized weight (what the
    engine ran before, and DeepSeek's einsum)."""
    from kernels.fp8_gemm import Fp8Weight
    from kernels.grouped_linear import grouped_linear_reference, grouped_linear_triton
    from kernels.quant_formats import dequantize_fp8

    groups, rows = s.o_groups, s.o_lora_rank
    k = s.num_heads * s.head_dim // groups
    gen = torch.Generator(device=device).manual_seed(0)
    weight = Fp8Weight(*fp8_linear_weight(torch, device, groups * rows, k, gen))
    dense = dequantize_fp8(weight.data, weight.scale).to(torch.bfloat16)
    results = []
    for t in s.fp8_tokens:
        x = torch.randn(t, groups, k, generator=gen, device=device).to(torch.bfloat16)
        work = ((weight.data.numel() + 4 * weight.scale.numel() + 2 * t * groups * (k + rows)) / 1e9,
                2 * t * groups * rows * k / 1e9)
        results.append(check_and_time(torch, timer, "grouped", f"o_a T={t}", lambda: grouped_linear_triton(x, weight),
                                      lambda: grouped_linear_reference(x, dense),
                                      lambda: grouped_linear_reference(x.float(), dense.float()), work, options))
    return results


def quantized_experts(torch, device, fmt: str, num_experts: int, n: int, k: int, halves: int, gen):
    """Random expert weights [E, N, K] as published, one expert at a time (no fp32 copy of them all)."""
    from kernels.moe import QuantizedExperts

    if fmt == "mxfp4":
        data = torch.randint(-128, 128, (num_experts, n, k // 2), generator=gen, device=device, dtype=torch.int8)
        # e8m0 2^-13..2^-8: activations of order 1 through both projections, as a trained model has (larger scales
        # give outputs in the hundreds, where bf16 rounding alone exceeds the fixed absolute tolerance)
        scale = torch.randint(114, 120, (num_experts, n, k // 32), generator=gen, device=device, dtype=torch.uint8)
        return QuantizedExperts("mxfp4", data, scale, (num_experts, n, k), n)
    data = torch.empty(num_experts, n, k, dtype=torch.float8_e4m3fn, device=device)
    for e in range(num_experts):
        data[e] = (torch.randn(n, k, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    rows = n // halves
    blocks = (num_experts, halves * -(-rows // 128), -(-k // 128))
    scale = torch.exp2(torch.randint(-16, -12, blocks, generator=gen, device=device).float())
    return QuantizedExperts("fp8", data, scale, (num_experts, n, k), rows)


def _dequantized_bf16(torch, experts):
    out = torch.empty(experts.shape, dtype=torch.bfloat16, device=experts.data.device)
    for e in range(experts.shape[0]):
        one = experts._replace(data=experts.data[e:e + 1], scale=experts.scale[e:e + 1], shape=(1, *experts.shape[1:]))
        out[e] = one.dequantize()[0].to(torch.bfloat16)
    return out


def bench_moe_quantized(torch, s, device, timer, options):
    from kernels.moe import fused_moe_reference, fused_moe_triton

    results = []
    gen = torch.Generator(device=device).manual_seed(1)
    # DeepSeek's numerics act_quant x and h in groups of 128 (the dry run's widths are too narrow)
    numerics = {"": {}, "deepseek ": dict(deepseek_order=True, quantize_hidden=True)}
    if s.hidden % 128 or s.moe_inter % 128:
        del numerics["deepseek "]
    # (bytes a weight, its scale's share with it: fp8's float32 per 128 x 128 block, mxfp4's e8m0 byte per 32)
    for fmt, weight_bytes in (("fp8", 1.0 + 4 / 128**2), ("mxfp4", 0.5 + 1 / 32)):
        gate_up = quantized_experts(torch, device, fmt, s.num_experts, 2 * s.moe_inter, s.hidden, 2, gen)
        down = quantized_experts(torch, device, fmt, s.num_experts, s.hidden, s.moe_inter, 1, gen)
        bf16 = (_dequantized_bf16(torch, gate_up), _dequantized_bf16(torch, down))
        gate_up, down = gate_up.for_kernels(), down.for_kernels()  # mxfp4 repacked, as the model does at load
        for label, order in numerics.items():
            for num_tokens in [*s.moe_decode_tokens, s.prefill_tokens]:
                x, ids, weights, *_ = moe_inputs(torch, s, device, num_tokens, bf16)
                name = f"{fmt} {label}{'prefill' if num_tokens == s.prefill_tokens else 'decode'} T={num_tokens}"
                actual = fused_moe_triton(x, ids, weights, gate_up, down, 10.0, **order)
                expected = fused_moe_reference(x, ids, weights, *bf16, 10.0, **order)
                error = _max_error(torch, actual, expected, *TOLERANCES["moe"])
                ms = timer(lambda: fused_moe_triton(x, ids, weights, gate_up, down, 10.0, **order))
                ref_ms = None if options.skip_reference else timer(
                    lambda: fused_moe_triton(x, ids, weights, *bf16, 10.0))
                status = "ok" if error <= 1 else f"MISMATCH (normalised error {error:.3g} > 1)"
                print(f"  {'moe_q':<10} {name:<24} {ms:9.3f} ms  bf16 {ref_ms or float('nan'):9.3f} ms  {status}",
                      flush=True)
                results.append(Result("moe_q", name, ms, ref_ms, *moe_work(s, ids, weight_bytes), error))
    return results


def bench_mhc(torch, s, device, timer, options, hc_mult=4):
    """Each output of the three mHC kernels checked against the fp32 reference; bf16 streams, fp32 parameters."""
    from kernels.mhc import (hc_collapse_reference, hc_collapse_triton, hc_head_reference, hc_head_triton,
                             hc_mix_reference, hc_mix_triton)

    n, d = hc_mult, s.hidden
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
    fn, base, scale, weight = rand(2 * n + n * n, n * d) * 0.1, rand(2 * n + n * n) * 0.5, 1 + rand(3) * 0.1, \
        1 + rand(d) * 0.1
    head_fn, head_base, head_scale = rand(n, n * d) * 0.1, rand(n) * 0.5, 1 + rand(1) * 0.1
    collapse_kw = dict(hc_mult=n, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    head_kw = dict(eps=1e-6, hc_eps=1e-6, norm_weight=weight)
    results = []
    for t in [*s.decode_batches, s.prefill_tokens]:
        streams = rand(t, n, d).to(torch.bfloat16)
        routed, shared = rand(t, d), rand(t, d).to(torch.bfloat16)
        post, comb, _ = hc_collapse_reference(streams.float(), fn, base, scale, weight, **collapse_kw)
        cases = [
            ("collapse", lambda: hc_collapse_triton(streams, fn, base, scale, weight, **collapse_kw),
             lambda: hc_collapse_reference(streams, fn, base, scale, weight, **collapse_kw),
             lambda: hc_collapse_reference(streams.float(), fn, base, scale, weight, **collapse_kw),
             (t * n * d * 2 + fn.numel() * 4 + t * d * 2 + t * (n + n * n) * 4, 2 * t * fn.numel())),
            ("mix", lambda: hc_mix_triton(streams, routed, post, comb, shared),
             lambda: hc_mix_reference(streams, routed, post, comb, shared),
             lambda: hc_mix_reference(streams.float(), routed, post, comb, shared.float()),
             (2 * t * n * d * 2 + t * d * (4 + 2), 2 * t * n * n * d)),
            ("head", lambda: hc_head_triton(streams, head_fn, head_base, head_scale, **head_kw),
             lambda: hc_head_reference(streams, head_fn, head_base, head_scale, **head_kw),
             lambda: hc_head_reference(streams.float(), head_fn, head_base, head_scale, **head_kw),
             (t * n * d * 2 + head_fn.numel() * 4 + t * d * 2, 2 * t * head_fn.numel())),
        ]
        for kind, kernel_fn, reference_fn, float_reference_fn, (nbytes, flops) in cases:
            name = f"{kind} {'prefill' if t == s.prefill_tokens else 'decode'} T={t}"
            results.append(check_and_time(torch, timer, "mhc", name, kernel_fn, reference_fn, float_reference_fn,
                                          (nbytes / 1e9, flops / 1e9), options))
    return results


def _glue_cases(torch, s, device, t, gen):
    """(name, kernel_fn, reference_fn, float_reference_fn, (bytes, flops)) for the glue kernels at T = t tokens;
    functions return tensors (stateful kernels return what they wrote)."""
    from backend.model.compressor import build_plan
    from kernels.compressor import compress_into_pool_reference, compress_into_pool_triton
    from kernels.moe import (clamped_swiglu, moe_align, moe_align_triton, route_hash, route_hash_triton, route_topk,
                             route_topk_triton, swiglu_triton)
    from kernels.norm_rope import norm_rope_reference, norm_rope_triton
    from kernels.token_bitmask import apply_token_bitmask_reference, apply_token_bitmask_triton

    bf16, f32 = torch.bfloat16, torch.float32
    rand = lambda *shape, dtype=bf16: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    half, dh = s.rope_dim // 2, s.head_dim
    cos, sin = rand(t, half).cos(), rand(t, half).sin()
    q_a, kv_col = rand(t, s.q_lora_rank), rand(t, 4 * dh)[:, :dh]
    w_q_a, w_kv = rand(s.q_lora_rank) * 0.1 + 1, rand(dh) * 0.1 + 1
    window = torch.zeros(t + 1, 1, dh, dtype=bf16, device=device)
    index = torch.randperm(t, generator=gen, device=device)
    logits, bias = rand(t, s.num_experts, dtype=f32), rand(s.num_experts, dtype=f32) * 0.1
    tid2eid = torch.randint(0, s.num_experts, (1000, s.top_k), generator=gen, device=device, dtype=torch.int32)
    input_ids = torch.randint(0, 1000, (t,), generator=gen, device=device)
    topk_ids = route_topk(logits, bias, s.top_k, 1.0)[0]
    gate_up = rand(t, 2 * s.moe_inter) * 4
    fl = lambda v: v.float()  # noqa: E731
    step_logits = rand(t, s.vocab, dtype=f32)  # structured outputs: every row of a decode batch constrained
    bitmask = torch.randint(-2**31, 2**31 - 1, (t, (s.vocab + 31) // 32), generator=gen, device=device,
                            dtype=torch.int64).to(torch.int32)
    masked_rows = torch.arange(t, device=device)

    def masked(fn):
        out = step_logits.clone()
        fn(out, bitmask, masked_rows)
        return out

    cases = [
        ("norm q_a", lambda: norm_rope_triton(q_a, w_q_a, 1e-6), lambda: norm_rope_reference(q_a, w_q_a, 1e-6),
         lambda: norm_rope_reference(fl(q_a), fl(w_q_a), 1e-6), (4 * t * s.q_lora_rank, 0)),
        ("norm+rope kv->pool", lambda: norm_rope_triton(kv_col, w_kv, 1e-6, cos=cos, sin=sin, out=window,
                                                        out_index=index)[:t],
         lambda: norm_rope_reference(kv_col, w_kv, 1e-6, cos=cos, sin=sin, out=window, out_index=index)[:t],
         lambda: norm_rope_reference(fl(kv_col), fl(w_kv), 1e-6, cos=fl(cos), sin=fl(sin), out=fl(window),
                                     out_index=index)[:t], (4 * t * dh, 0)),
        ("route topk", lambda: _sorted_route(torch, route_topk_triton(logits, bias, s.top_k, 1.0)),
         lambda: _sorted_route(torch, route_topk(logits, bias, s.top_k, 1.0)),
         lambda: _sorted_route(torch, route_topk(logits, bias, s.top_k, 1.0)), (4 * t * s.num_experts, 0)),
        ("route hash", lambda: route_hash_triton(logits, tid2eid, input_ids, 1.0)[1],
         lambda: route_hash(logits, tid2eid, input_ids, 1.0)[1], lambda: route_hash(logits, tid2eid, input_ids, 1.0)[1],
         (t * s.top_k * 16, 0)),
        ("moe align", lambda: moe_align_triton(topk_ids, s.num_experts, 16)[0].float(),
         lambda: moe_align(topk_ids, s.num_experts, 16)[0].float(),
         lambda: moe_align(topk_ids, s.num_experts, 16)[0].float(), (3 * t * s.top_k * 8, 0)),
        ("swiglu", lambda: swiglu_triton(gate_up, 10.0), lambda: clamped_swiglu(gate_up, 10.0),
         lambda: clamped_swiglu(fl(gate_up), 10.0), (6 * t * s.moe_inter, 0)),
        ("token bitmask", lambda: masked(apply_token_bitmask_triton), lambda: masked(apply_token_bitmask_reference),
         lambda: masked(apply_token_bitmask_reference), (t * s.vocab * (2 * 4 + 4 / 32), 0)),  # (clone included)
    ]
    for kind, rate, overlap, head_dim in (("csa", s.csa_rate, True, dh), ("hca", s.hca_rate, False, dh),
                                          ("indexer", s.csa_rate, True, s.index_head_dim)):
        run, work = _compressor_run(torch, s, device, gen, t, rate, overlap, head_dim, build_plan)
        cases.append((f"compress {kind}", lambda run=run: run(compress_into_pool_triton),
                      lambda run=run: run(compress_into_pool_reference),
                      lambda run=run: run(compress_into_pool_reference, lambda v: v.float()), work))
    cases.append(("compress csa+indexer", *_compressor_pair_fns(torch, s, device, gen, t, build_plan)))
    return cases


def _compressor_pair_fns(torch, s, device, gen, t, build_plan):
    """A CSA layer's two compressors over one plan in one launch (`pair_compress_launches`), against their two
    launches (its reference: the same bytes) and the float reference; each returns both pools (compared pairwise)."""
    from kernels.common import launch
    from kernels.compressor import (compress_into_pool_reference, compress_into_pool_triton, pair_compress_launches,
                                    plan_compress_into_pool)

    plan = _compressor_plan(s, device, t, s.csa_rate, True, build_plan)
    runs, works = zip(*(_compressor_run(torch, s, device, gen, t, s.csa_rate, True, head_dim, build_plan, plan)
                        for head_dim in (s.head_dim, s.index_head_dim)))

    def both(fn, cast=lambda v: v):
        return tuple(run(fn, cast) for run in runs)

    def paired():
        planned = []

        def plan_it(*args):
            planned.append(plan_compress_into_pool(*args))

        pools = tuple(run(plan_it) for run in runs)
        launch(pair_compress_launches(*planned))
        return pools

    return (paired, lambda: both(compress_into_pool_triton), lambda: both(compress_into_pool_reference),
            tuple(map(sum, zip(*works))))


def _sorted_route(torch, route):
    ids, weights = route
    order = ids.argsort(dim=-1)
    return torch.cat([ids.gather(1, order).float(), weights.gather(1, order)], dim=1)


def _compressor_starts(s, t, rate) -> tuple[list[int], list[int]]:
    """(starts, lengths) of the rows: a decode batch of t rows each closing an entry, or (t = the prefill chunk) one row
    of t tokens."""
    prefill = t == s.prefill_tokens
    return ([0], [t]) if prefill else ([(r + 8) * rate - 1 for r in range(t)], [1] * t)


def _compressor_plan(s, device, t, rate, overlap, build_plan):
    starts, lens = _compressor_starts(s, t, rate)
    rows = len(starts)
    return build_plan(rate, overlap, starts, lens, list(range(0, t, max(1, t // rows)))[:rows], list(range(rows)),
                      device)


def _compressor_run(torch, s, device, gen, t, rate, overlap, head_dim, build_plan, plan=None):
    """(run(fn, cast) -> the pool fn wrote, (bytes, flops)) of a compressor over `_compressor_starts`'s rows (its own
    plan, or `plan`): fn is compress_into_pool_triton / _reference, or anything of their arguments. Each fn (and
    cast) writes a copy of the pool and rings of its own, made at its first call (the one checked): the timed calls
    write it again, so that no copy is timed (the work counted is the compressor's alone)."""
    width, ring = (2 if overlap else 1) * head_dim, (2 if overlap else 1) * rate
    starts, _ = _compressor_starts(s, t, rate)
    rows = len(starts)
    plan = plan or _compressor_plan(s, device, t, rate, overlap, build_plan)
    entries = plan.num_entries
    rand = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa
    projection = rand(t, 2 * width)
    state_kv, state_gate = rand(rows + 1, ring, width), rand(rows + 1, ring, width)
    bias, norm_w = rand(rate, width, dtype=torch.float32), rand(head_dim) * 0.1 + 1
    cos, sin = rand(entries, s.rope_dim // 2).cos(), rand(entries, s.rope_dim // 2).sin()
    pages = -(-(max(starts) + t) // rate // s.page_size) + 1
    pool = torch.zeros(rows * pages + 1, s.page_size, head_dim, dtype=torch.bfloat16, device=device)
    table = torch.arange(rows * pages, device=device, dtype=torch.int32).view(rows, pages)

    copies = {}  # (fn's name, the cast's dtype) -> (pool, ring of values, ring of gates) that fn writes

    def run(fn, cast=lambda v: v):
        key = getattr(fn, "__name__", "?"), cast(norm_w).dtype
        if key not in copies:
            copies[key] = cast(pool).clone(), cast(state_kv).clone(), cast(state_gate).clone()
        out, kv, gate = copies[key]
        fn(cast(projection[:, :width]), cast(projection[:, width:]), kv, gate, plan, bias, cast(norm_w), 1e-6,
           cast(cos), cast(sin), out, table)
        return out

    return run, (2 * 2 * entries * ring * head_dim + 2 * entries * head_dim, 0)


def bench_glue(torch, s, device, timer, options):
    results = []
    gen = torch.Generator(device=device).manual_seed(0)
    for t in [*s.decode_batches, s.prefill_tokens]:
        for kind, kernel_fn, reference_fn, float_reference_fn, (nbytes, flops) in _glue_cases(torch, s, device, t, gen):
            name = f"{kind} {'prefill' if t == s.prefill_tokens else 'decode'} T={t}"
            results.append(check_and_time(torch, timer, "glue", name, kernel_fn, reference_fn, float_reference_fn,
                                          (nbytes / 1e9, flops / 1e9), options,
                                          "compress" if kind.startswith("compress") else None))
    return results


def fp8_layout_shapes(s: Shapes) -> Shapes:
    """The shapes, widened where the fp8 layout's groups need it (the dry run's 64-wide heads: 128, 64 rope dims)."""
    if (s.head_dim - s.rope_dim) % 64 == 0 and s.index_head_dim % 32 == 0:
        return s
    return replace(s, head_dim=128, rope_dim=64)


def fp8_attention_inputs(torch, s: Shapes, device, positions, mode: str):
    """attention_inputs with the pools in DeepSeek's fp8 layout: (args, kwargs, kwargs with the values the pools'
    bytes decode to, for the float32 reference)."""
    from kernels.quant_formats import pack_kv_fp8, unpack_kv_fp8

    args, kwargs = attention_inputs(torch, s, device, positions, mode)
    kwargs["rope_dim"] = s.rope_dim
    values = dict(kwargs, rope_dim=0)
    for pool in ("window_kv", "comp_kv"):
        if pool in kwargs:
            kwargs[pool] = pack_kv_fp8(kwargs[pool], s.rope_dim)
            values[pool] = unpack_kv_fp8(kwargs[pool], s.head_dim, s.rope_dim, torch.float32)
    return args, kwargs, values


def fp4_indexer_inputs(torch, s: Shapes, device, positions):
    """indexer_inputs with the keys as FP4 (kv_cache_dtype fp8): (args, float32 args of the values they decode to)."""
    from kernels.quant_formats import pack_indexer_fp4, unpack_indexer_fp4

    args = list(indexer_inputs(torch, s, device, positions))
    args[5] = pack_indexer_fp4(args[5])
    values = _to_float(torch, args)
    values[5] = unpack_indexer_fp4(args[5], s.index_head_dim, torch.float32)
    return args, values


def bench_attention_fp8(torch, s, device, timer, options):
    """The attention over pools in DeepSeek's fp8 layout (kv_cache_dtype fp8), checked against the reference on the
    values the bytes hold; GB counts the layout's bytes per key (584 for V4 against 1,024)."""
    from kernels.attention import sparse_paged_attention_reference, sparse_paged_attention_triton
    from kernels.quant_formats import kv_fp8_entry_bytes

    s = fp8_layout_shapes(s)
    entry_bytes = kv_fp8_entry_bytes(s.head_dim, s.rope_dim)
    results = []
    for mode, name, positions in attention_cases(s):
        args, kwargs, values = fp8_attention_inputs(torch, s, device, positions, mode)
        results.append(check_and_time(
            torch, timer, "attn_fp8", name,
            lambda: sparse_paged_attention_triton(*args, **kwargs),
            lambda: sparse_paged_attention_reference(*args, **kwargs),
            lambda: sparse_paged_attention_reference(*_to_float(torch, args), **values),
            attention_work(s, positions, mode, entry_bytes), options))
        args = kwargs = values = None  # (freed before the next case's inputs are made)
    return results


def bench_indexer_fp4(torch, s, device, timer, options):
    """The indexer over FP4 keys (kv_cache_dtype fp8); GB counts the layout's bytes per key (68 for V4 against 256)."""
    from kernels.indexer import indexer_scores_reference, indexer_scores_triton
    from kernels.quant_formats import indexer_fp4_entry_bytes

    s = fp8_layout_shapes(s)
    results = []
    for name, positions in indexer_cases(s):
        args, values = fp4_indexer_inputs(torch, s, device, positions)
        results.append(check_and_time(
            torch, timer, "idx_fp4", name, lambda: indexer_scores_triton(*args),
            lambda: indexer_scores_reference(*args), lambda: indexer_scores_reference(*values),
            indexer_work(s, positions, indexer_fp4_entry_bytes(s.index_head_dim)), options))
    return results


BENCHES = {"attention": bench_attention, "attention_fp8": bench_attention_fp8, "indexer": bench_indexer,
           "indexer_fp4": bench_indexer_fp4, "moe": bench_moe, "moe_q": bench_moe_quantized,
           "fp8_gemm": bench_fp8_gemm, "fp32_linear": bench_fp32_linear, "grouped_linear": bench_grouped_linear,
           "mhc": bench_mhc, "glue": bench_glue}


def _print_table(rows):
    print(f"\n{'kernel':<10} {'case':<24} {'ms':>9} {'ref ms':>9} {'x ref':>6} {'GB/s':>8} {'%copy':>6} "
          f"{'TFLOP/s':>8} {'%mm':>5}")
    fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    for r in rows:
        print(f"{r['kernel']:<10} {r['case']:<24} {fmt(r['ms'], '9.3f')} {fmt(r['reference_ms'], '9.3f')} "
              f"{fmt(r.get('speedup'), '6.1f')} {fmt(r.get('gbps'), '8.0f')} {fmt(r.get('pct_copy_bw'), '6.1f')} "
              f"{fmt(r.get('tflops'), '8.1f')} {fmt(r.get('pct_matmul'), '5.1f')}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="attention,attention_fp8,indexer,indexer_fp4,moe,moe_q,fp8_gemm,"
                                             "fp32_linear,grouped_linear,mhc,glue",
                        help="comma-separated subset")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per case (median reported)")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the references")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    parser.add_argument("--csv", type=Path, help="write the results as CSV")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU only: small shapes, kernels under the Triton interpreter, one timed run")
    options = parser.parse_args()
    kernels = [k.strip() for k in options.kernels.split(",") if k.strip()]
    unknown = set(kernels) - set(BENCHES)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {sorted(BENCHES)}")
    if options.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        options.repeat = 1

    import torch

    if not options.dry_run and not torch.cuda.is_available():
        print("bench_kernels.py needs an NVIDIA GPU with a CUDA build of torch (torch.cuda.is_available() is False; "
              f"torch {torch.__version__}). Use --dry-run to check the script on CPU.", file=sys.stderr)
        return 2
    device = torch.device("cpu" if options.dry_run else "cuda")
    shapes = DRY if options.dry_run else FULL
    timer = Timer(torch, device, options.repeat)
    copy_gbps, matmul_tflops = measure_device(torch, device, timer)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    if copy_gbps:
        print(f"device: {name}; measured copy {copy_gbps:.0f} GB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s")
    else:
        print(f"device: {name}; no bandwidth or matmul baseline")

    meta = dict(device=name, copy_gbps=copy_gbps, matmul_tflops=matmul_tflops, dry_run=options.dry_run,
                shapes=asdict(shapes))
    results, rows = [], []
    for kernel in kernels:  # (written after each kernel: a run stopped by its time limit keeps what it timed)
        results += BENCHES[kernel](torch, shapes, device, timer, options)
        rows = [r.derived(copy_gbps, matmul_tflops) for r in results]
        _write(options, meta, rows)
    _print_table(rows)
    mismatches = [r for r in results if not r.max_error <= 1]
    for r in mismatches:
        print(f"MISMATCH {r.kernel} {r.case}: normalised error {r.max_error:.3g}", file=sys.stderr)
    return 1 if mismatches else 0


def _write(options, meta: dict, rows: list[dict]) -> None:
    if options.json:
        options.json.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    if options.csv:
        write_csv(options.csv, rows, ["kernel", "case", "ms", "reference_ms", "speedup", "gbytes", "gflop", "gbps",
                                      "pct_copy_bw", "tflops", "pct_matmul", "max_error"])


if __name__ == "__main__":
    sys.exit(main())
