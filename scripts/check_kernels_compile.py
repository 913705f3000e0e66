#!/usr/bin/env python
"""Compile every Triton kernel, in every configuration the engine launches, for Hopper (sm_90), without a GPU.

The launches come from the kernels' own plan functions (`plan_sparse_paged_attention`, `plan_indexer_scores`,
`plan_fused_moe` with its alignment, `plan_fp8_gemm`, the mHC, norm+rope, routing, swiglu, compressor and token-bitmask
plans) called on meta tensors of each model's shapes, so the tiles, constexprs and argument specialisation are
exactly what the wrappers would launch. Each is compiled with triton.compile for
GPUTarget("cuda", 90, 32), as `kernels.common.launch` launches it with programmatic dependent launch on (PDL=True);
registers, stack/local bytes come from the bundled `cuobjdump -res-usage`, shared memory from the compiled metadata,
wgmma and griddepcontrol from the PTX.

Exit status 1 when any kernel spills registers (stack or local memory in use), needs more than 227 KB of shared memory,
does not wait for the kernel before it (no griddepcontrol.wait, or memory read or written before it: a weight's L2
prefetch may come first: `pdl_problem`), or decodes MXFP4, FP4 keys or e4m3 weights without its asm
(`decode_asm_problem`); a table of every compiled kernel is printed either way.

  python scripts/check_kernels_compile.py            # all models, all cases
  python scripts/check_kernels_compile.py --quick    # a subset for CI (tests/kernels/test_compile.py)
  python scripts/check_kernels_compile.py --sass "moe fp8 .*T=256"   # and what each main loop issues per byte
                                                     # it streams (weights, or keys), from its SASS (kernel_sass.py)
  python scripts/check_kernels_compile.py --config kernels/configs/NVIDIA_H200.json  # the tiles a device's tuned
                                                     # table gives (kernels/tuning.py), compiled by this Triton
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # kernels must be JIT functions, not interpreted
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from backend.model.compressor import CompressionPlan  # noqa: E402
from kernels import tuning  # noqa: E402
from kernels.act_rounding import plan_round  # noqa: E402
from kernels.attention import plan_sparse_paged_attention  # noqa: E402
from kernels.common import set_programmatic_dependent_launch  # noqa: E402
from kernels.compressor import pair_compress_launches, plan_compress_into_pool  # noqa: E402
from kernels.fp32_linear import plan_fp32_linear  # noqa: E402
from kernels.fp8_gemm import Fp8Weight, plan_fp8_gemm  # noqa: E402
from kernels.grouped_linear import plan_grouped_linear  # noqa: E402
from kernels.indexer import plan_indexer_scores  # noqa: E402
from kernels.mhc import plan_hc_collapse, plan_hc_head, plan_hc_mix, plan_hc_mix_collapse  # noqa: E402
from kernels.moe import QuantizedExperts, Routing, plan_fused_moe, plan_routed_alignment, plan_swiglu  # noqa: E402
from kernels.kv_store import plan_store_indexer_fp4, plan_store_kv_fp8  # noqa: E402
from kernels.norm_rope import plan_norm_rope  # noqa: E402
from kernels.quant_formats import (E4M3_PAIR_ASM, FP4_PAIR_ASM, MXFP4_GROUP_ASM, indexer_fp4_entry_bytes,  # noqa: E402
                                   kv_fp8_entry_bytes)
from kernels.token_bitmask import plan_apply_token_bitmask  # noqa: E402
from scripts.kernel_sass import describe, loop_profile, pdl_problem, program_length  # noqa: E402

# every launch planned as with programmatic dependent launch on (the weight-streaming kernels' prefetch lines), and
# compiled so (PDL=True: compile_case)
set_programmatic_dependent_launch(True)

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

# Shapes the engine runs. "tiny" is scripts/make_checkpoint.py's TINY_CONFIG (the test model).
MODELS = [
    dict(name="v4-flash", head_dim=512, num_heads=64, index_head_dim=128, index_heads=64, index_topk=512,
         q_lora_rank=1024, rope_dim=64,
         hidden=4096, moe_inter=2048, num_experts=256, top_k=6, window=128, csa_rate=4, hca_rate=128,
         page_size=64, max_context=65536, decode_batches=[1, 8, 32, 64, 128, 256], prefill_tokens=4096,
         moe_tokens=[1, 256, 1024, 4096], vocab=129280),
    dict(name="tiny", head_dim=64, num_heads=4, index_head_dim=32, index_heads=16, index_topk=8,
         q_lora_rank=48, rope_dim=16,
         hidden=64, moe_inter=32, num_experts=8, top_k=2, window=128, csa_rate=4, hca_rate=128,
         page_size=64, max_context=65536, decode_batches=[1, 8, 64], prefill_tokens=512,
         moe_tokens=[1, 128, 512], vocab=512),
]
QUICK = {("v4-flash", "attention csa decode T=1"), ("v4-flash", "attention csa prefill T=4096"),
         ("v4-flash", "indexer T=1"), ("v4-flash", "attention csa fp8 kv decode T=1"),
         ("v4-flash", "indexer fp4 keys T=1"), ("v4-flash", "moe mxfp4 deepseek T=1"),
         ("v4-flash", "store kv fp8 N=1"), ("v4-flash", "store indexer fp4 N=1"), ("v4-flash", "moe T=1"),
         ("v4-flash", "round activations T=256"), ("v4-flash", "round indexer queries T=256"),
         ("v4-flash", "fp32 linear lm head T=1"), ("v4-flash", "fp32 linear lm head T=256"),
         ("v4-flash", "grouped fp8 o_a T=1"), ("v4-flash", "grouped fp8 o_a T=256"),
         ("v4-flash", "norm_rope indexer_q fp4 T=64"), ("v4-flash", "mhc mix_collapse T=1"),
         ("v4-flash", "norm_rope kv fp8 T=64"), ("v4-flash", "compressor csa fp32 fp8 64x1"),
         ("v4-flash", "moe T=4096"),
         ("tiny", "attention hca prefill T=512"), ("v4-flash", "fp8 gemm wq_b T=1"),
         ("v4-flash", "fp8 gemm wo_b T=4096"),
         ("v4-flash", "moe mxfp4 T=1"), ("v4-flash", "moe fp8 T=4096"), ("v4-flash", "norm_rope kv T=64"),
         ("v4-flash", "route topk T=64"), ("v4-flash", "swiglu T=64"), ("v4-flash", "compressor hca 64x1"),
         ("v4-flash", "compressor csa 1x4096"), ("v4-flash", "token bitmask R=256")}
# The FP8 linears of V4-Flash (N, K), as DeepSeek publishes them.
FP8_LINEARS = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_a": (8192, 4096),
               "wo_b": (4096, 8192), "shared w1": (2048, 4096), "shared w2": (4096, 2048),
               "index wq_b": (8192, 1024)}
FP8_PROLOGUES = {"wq_b": "rms_norm", "index wq_b": "rms_norm", "shared w2": "swiglu"}  # computed as x is loaded
FP8_HEAD_ROPES = {"index wq_b": 128}  # heads of this width roped and rounded as stored (the indexer's queries)


@dataclass
class Compiled:
    kernel: str
    config: str
    registers: int
    shared: int
    spill_bytes: int  # stack + local memory
    wgmma: bool
    seconds: float
    loop: str = ""  # --sass: what the main loop issues per iteration and per weight byte
    decode_asm: str = ""  # what is wrong with the asm instances of its MXFP4 or FP4 decode, if anything
    pdl: str = ""  # what makes it unsafe to launch with programmatic dependent launch, if anything (`pdl_problem`)

    @property
    def problem(self) -> str:
        if self.pdl:
            return self.pdl
        if self.spill_bytes:
            return f"spills {self.spill_bytes} B"
        if self.shared > SHARED_LIMIT:
            return f"shared {self.shared} B > {SHARED_LIMIT} B"
        return self.decode_asm


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _kv_pool(m: dict, fp8: bool):
    """4096 pages of attention entries: bf16 values, or the fp8 layout's bytes (kv_cache_dtype fp8)."""
    if fp8:
        return _meta(4096, m["page_size"], kv_fp8_entry_bytes(m["head_dim"], m["rope_dim"]), dtype=torch.uint8)
    return _meta(4096, m["page_size"], m["head_dim"])


def attention_launches(m: dict, mode: str, num_tokens: int, fp8: bool = False):
    num_seqs = num_tokens if num_tokens <= 256 else 1
    comp_rate = m["csa_rate"] if mode == "csa" else m["hca_rate"]
    comp_pages = m["max_context"] // comp_rate // m["page_size"]
    kwargs = dict(
        sinks=_meta(m["num_heads"], dtype=torch.float32), scale=m["head_dim"] ** -0.5,
        token_seq=_meta(num_tokens, dtype=torch.int32), token_pos=_meta(num_tokens, dtype=torch.int64),
        window_kv=_kv_pool(m, fp8),
        window_block_table=_meta(num_seqs, 8 + num_tokens // m["page_size"], dtype=torch.int32),
        window_first_page=_meta(num_seqs, dtype=torch.int64), window=m["window"], rope_dim=m["rope_dim"],
        q_norm_eps=1e-6, rope=(_meta(num_tokens, m["rope_dim"] // 2), _meta(num_tokens, m["rope_dim"] // 2)))
    if mode != "window":
        kwargs.update(comp_kv=_kv_pool(m, fp8),
                      comp_block_table=_meta(num_seqs, comp_pages, dtype=torch.int32), compress_rate=comp_rate)
    if mode == "csa":
        kwargs["topk_indices"] = _meta(num_tokens, m["index_topk"], dtype=torch.int32)
    return plan_sparse_paged_attention(_meta(num_tokens, m["num_heads"], m["head_dim"]), **kwargs)[1]


def indexer_launches(m: dict, num_tokens: int, fp4: bool = False):
    num_seqs = num_tokens if num_tokens <= 256 else 1
    pages = m["max_context"] // m["csa_rate"] // m["page_size"]
    keys = (_meta(4096, m["page_size"], indexer_fp4_entry_bytes(m["index_head_dim"]), dtype=torch.uint8) if fp4
            else _meta(4096, m["page_size"], m["index_head_dim"]))
    return plan_indexer_scores(
        _meta(num_tokens, m["index_heads"], m["index_head_dim"]), _meta(num_tokens, m["index_heads"],
                                                                       dtype=torch.float32),
        m["index_head_dim"] ** -0.5, _meta(num_tokens, dtype=torch.int32), _meta(num_tokens, dtype=torch.int64),
        keys, _meta(num_seqs, pages, dtype=torch.int32), m["csa_rate"], max_entries=8192 // m["csa_rate"])[1]


def _experts(fmt: str, num_experts: int, n: int, k: int, halves: int):
    """Expert weights [E, N, K] as the kernel takes them: bf16, fp8 as published, mxfp4 repacked for the kernels."""
    if fmt == "bf16":
        return _meta(num_experts, n, k)
    if fmt == "mxfp4":
        chunks = -(-k // 128)
        return QuantizedExperts("mxfp4_kernel", _meta(num_experts, n, 16 * chunks, dtype=torch.int32),
                                _meta(num_experts, n, 4 * chunks, dtype=torch.uint8), (num_experts, n, k), n)
    rows = n // halves
    scale = _meta(num_experts, halves * -(-rows // 128), -(-k // 128), dtype=torch.float32)
    return QuantizedExperts("fp8", _meta(num_experts, n, k, dtype=torch.float8_e4m3fn), scale, (num_experts, n, k),
                            rows)


def moe_launches(m: dict, num_tokens: int, fmt: str = "bf16", deepseek: bool = False):
    """deepseek: DeepSeek's numerics on its quantized experts (routing weight first, the down input act_quant'ed)."""
    e, d, i = m["num_experts"], m["hidden"], m["moe_inter"]
    return plan_fused_moe(
        _meta(num_tokens, m["hidden"]), _meta(num_tokens, m["top_k"], dtype=torch.int64),
        _meta(num_tokens, m["top_k"], dtype=torch.float32), _experts(fmt, e, 2 * i, d, 2), _experts(fmt, e, d, i, 1),
        10.0, deepseek_order=deepseek, quantize_hidden=deepseek)[1]


def mhc_launches(m: dict, num_tokens: int, kind: str, hc_mult: int = 4):
    """The mHC kernels on bf16 streams [T, 4, D]: collapse (+ RMSNorm), mix (+ a second block output), head, and the
    mix fused into the collapse after it (mix_collapse: the MoE's fp32 routed output and the shared expert's;
    mix_collapse act_quant: the attention's output, x also written act_quant'ed for the experts)."""
    n, d = hc_mult, m["hidden"]
    streams, f32 = _meta(num_tokens, n, d), torch.float32
    collapse = (_meta(2 * n + n * n, n * d, dtype=f32), _meta(2 * n + n * n, dtype=f32), _meta(3, dtype=f32),
                _meta(d, dtype=f32))
    if kind == "collapse":
        return plan_hc_collapse(streams, *collapse, hc_mult=n, eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)[1]
    if kind == "mix_collapse":
        return plan_hc_mix_collapse(streams, _meta(num_tokens, d, dtype=f32), _meta(num_tokens, n, dtype=f32),
                                    _meta(num_tokens, n, n, dtype=f32), _meta(num_tokens, d), *collapse, hc_mult=n,
                                    eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20, fp32_mix=True)[1]
    if kind == "mix_collapse act_quant":
        return plan_hc_mix_collapse(streams, _meta(num_tokens, d), _meta(num_tokens, n, dtype=f32),
                                    _meta(num_tokens, n, n, dtype=f32), None, *collapse, hc_mult=n, eps=1e-6,
                                    hc_eps=1e-6, sinkhorn_iters=20, fp32_mix=True, quantize_x=True)[1]
    if kind == "head":
        return plan_hc_head(streams, _meta(n, n * d, dtype=f32), _meta(n, dtype=f32), _meta(1, dtype=f32), eps=1e-6,
                            hc_eps=1e-6, norm_weight=_meta(d, dtype=f32))[1]
    return plan_hc_mix(streams, _meta(num_tokens, d, dtype=f32), _meta(num_tokens, n, dtype=f32),
                       _meta(num_tokens, n, n, dtype=f32), _meta(num_tokens, d))[1]


def norm_rope_launches(m: dict, num_tokens: int, use: str, fp8: bool = False):
    """The uses of a layer (the attention kernel norms and ropes its queries and un-ropes its output itself): q_a
    norm, kv norm + rope into the window pool, the indexer's query rope (with DeepSeek's rotation and FP4 rounding:
    "indexer_q fp4")."""
    t, dh, half = num_tokens, m["head_dim"], m["rope_dim"] // 2
    rope = dict(cos=_meta(t, half), sin=_meta(t, half))
    if use == "q_a":
        return plan_norm_rope(_meta(t, m["q_lora_rank"]), _meta(m["q_lora_rank"]), 1e-6)[1]
    if use == "kv":
        wide = _meta(t, 4 * dh)[:, :dh]  # a column view of the fused attention-input projection
        return plan_norm_rope(wide, _meta(dh), 1e-6, out=_kv_pool(m, fp8), out_index=_meta(t, dtype=torch.int64),
                              **rope)[1]
    return plan_norm_rope(_meta(t, m["index_heads"], m["index_head_dim"]), None, 1e-6, normalize=False,
                          round_indexer=use == "indexer_q fp4", **rope)[1]


def routing_launches(m: dict, num_tokens: int, kind: str, aligned: bool = False):
    """The routing kernel's launch; aligned: the routing with the experts' alignment (one launch at decode sizes)."""
    logits, f32 = _meta(num_tokens, m["num_experts"], dtype=torch.float32), torch.float32
    if kind == "topk":
        routing = Routing(logits, _meta(m["num_experts"], dtype=f32), m["top_k"], 1.5)
    else:
        routing = Routing(logits, _meta(129280, m["top_k"], dtype=torch.int32), m["top_k"], 1.5,
                          _meta(num_tokens, dtype=torch.int64))
    return plan_routed_alignment(routing, m["num_experts"], 16)[1] if aligned else routing.plan()[1]


def compressor_launches(m: dict, kind: str, num_rows: int, tokens_per_row: int, fp8: bool = False,
                        fp32: bool = False):
    """A compressor over num_rows rows of tokens_per_row tokens: kind csa / hca / indexer. fp8: into a pool of the
    fp8 layout (the indexer's: FP4 keys); fp32: DeepSeek's numerics (fp32 projections and rings, bf16 entries)."""
    rate = m["hca_rate"] if kind == "hca" else m["csa_rate"]
    overlap = kind != "hca"
    head_dim = m["index_head_dim"] if kind == "indexer" else m["head_dim"]
    width, ring = (2 if overlap else 1) * head_dim, (2 if overlap else 1) * rate
    num_tokens = num_rows * tokens_per_row
    entries = num_rows if tokens_per_row == 1 else num_tokens // rate
    keep = num_rows * min(ring, tokens_per_row)
    i64 = torch.int64
    plan = CompressionPlan(
        rate=rate, overlap=overlap, ring=ring, ring_slots=_meta(num_rows, dtype=i64),
        ring_order=_meta(num_rows, ring, dtype=i64), entry_src=_meta(entries, ring, dtype=i64),
        entry_valid=_meta(entries, ring, dtype=torch.bool), entry_pos=_meta(entries, dtype=i64),
        entry_row=_meta(entries, dtype=i64), entry_index=_meta(entries, dtype=i64), keep_src=_meta(keep, dtype=i64),
        keep_slot=_meta(keep, dtype=i64), keep_pos=_meta(keep, dtype=i64))
    dtype = torch.float32 if fp32 else torch.bfloat16
    projection = _meta(num_tokens, 4 * width, dtype=dtype)  # column views of the fused attention-input projection
    half = m["rope_dim"] // 2
    keys = kind == "indexer"
    if fp8:
        pool = (_meta(4096, m["page_size"], indexer_fp4_entry_bytes(head_dim), dtype=torch.uint8) if keys
                else _kv_pool(m, True))
    else:
        pool = _meta(4096, m["page_size"], head_dim)
    return plan_compress_into_pool(
        projection[:, :width], projection[:, width:2 * width], _meta(257, ring, width, dtype=dtype),
        _meta(257, ring, width, dtype=dtype), plan, _meta(rate, width, dtype=torch.float32), _meta(head_dim), 1e-6,
        _meta(entries, half), _meta(entries, half), pool, _meta(num_rows, 1024, dtype=torch.int32),
        entry_dtype=torch.bfloat16, keys=keys)


def fp8_gemm_launches(num_tokens: int, n: int, k: int, prologue: str | None = None, head_dim: int | None = None):
    """prologue "swiglu": the GEMM's input the SwiGLU of a gate|up product of twice its K (the shared expert's w2);
    "rms_norm": the RMSNorm of its input (q_a's, for wq_b and the indexer's wq_b). head_dim: the output's heads
    roped (64 channels) and rounded as DeepSeek rounds the indexer's queries, as they are stored."""
    w_scale = _meta(-(-n // 128), -(-k // 128), dtype=torch.float32)
    x = _meta(num_tokens, 2 * k if prologue == "swiglu" else k)
    rope = (_meta(num_tokens, 32), _meta(num_tokens, 32), head_dim) if head_dim else None
    return plan_fp8_gemm(x, _meta(n, k, dtype=torch.float8_e4m3fn), w_scale,
                         swiglu_limit=10.0 if prologue == "swiglu" else None,
                         rms_norm=(_meta(k), 1e-6) if prologue == "rms_norm" else None, rope=rope,
                         round_indexer=head_dim is not None)[1]


def cases() -> list[tuple[str, str, list]]:
    """(model, case, launches) for every case; launches are (kernel, grid, args, kwargs)."""
    out = []
    for m in MODELS:
        for mode in ("window", "hca", "csa"):
            for t in m["decode_batches"]:
                out.append((m["name"], f"attention {mode} decode T={t}", attention_launches(m, mode, t)))
            t = m["prefill_tokens"]
            out.append((m["name"], f"attention {mode} prefill T={t}", attention_launches(m, mode, t)))
        for t in (1, m["prefill_tokens"]):
            out.append((m["name"], f"indexer T={t}", indexer_launches(m, t)))
        for t in m["moe_tokens"]:
            out.append((m["name"], f"moe T={t}", moe_launches(m, t)))
        for t in sorted({1, 64, 256, m["prefill_tokens"]}):
            for kind in ("collapse", "mix", "head", "mix_collapse", "mix_collapse act_quant"):
                out.append((m["name"], f"mhc {kind} T={t}", mhc_launches(m, t, kind)))
        for t in (1, 64, m["prefill_tokens"]):
            for use in ("q_a", "kv", "indexer_q"):
                out.append((m["name"], f"norm_rope {use} T={t}", norm_rope_launches(m, t, use)))
            for kind in ("topk", "hash"):
                out.append((m["name"], f"route {kind} T={t}", routing_launches(m, t, kind)))
                out.append((m["name"], f"route+align {kind} T={t}", routing_launches(m, t, kind, aligned=True)))
            out.append((m["name"], f"swiglu T={t}", plan_swiglu(_meta(t, 2 * m["moe_inter"]), 10.0)[1]))
        for rows in (1, m["decode_batches"][-1]):  # constrained rows of a step: fp32 logits over the vocabulary
            out.append((m["name"], f"token bitmask R={rows}", plan_apply_token_bitmask(
                _meta(rows, m["vocab"], dtype=torch.float32), _meta(rows, (m["vocab"] + 31) // 32, dtype=torch.int32),
                _meta(rows, dtype=torch.long))))
        for kind in ("csa", "hca", "indexer"):
            for rows, tokens in ((1, 1), (64, 1), (1, m["prefill_tokens"])):
                out.append((m["name"], f"compressor {kind} {rows}x{tokens}",
                            compressor_launches(m, kind, rows, tokens)))
        for rows, tokens in ((1, 1), (64, 1), (1, m["prefill_tokens"])):  # a CSA layer's two, as the model runs them
            out.append((m["name"], f"compressors csa+indexer {rows}x{tokens}", pair_compress_launches(
                compressor_launches(m, "csa", rows, tokens), compressor_launches(m, "indexer", rows, tokens))))
    flash = MODELS[0]
    for mode in ("window", "hca", "csa"):  # kv_cache_dtype fp8: the entries decoded in registers
        for t in (1, 64, 256):
            out.append(("v4-flash", f"attention {mode} fp8 kv decode T={t}", attention_launches(flash, mode, t, True)))
        t = flash["prefill_tokens"]
        out.append(("v4-flash", f"attention {mode} fp8 kv prefill T={t}", attention_launches(flash, mode, t, True)))
    for t in (1, 64, flash["prefill_tokens"]):  # the window write, quantized in the norm_rope kernel
        out.append(("v4-flash", f"norm_rope kv fp8 T={t}", norm_rope_launches(flash, t, "kv", fp8=True)))
        out.append(("v4-flash", f"norm_rope indexer_q fp4 T={t}", norm_rope_launches(flash, t, "indexer_q fp4")))
    for kind in ("csa", "hca", "indexer"):  # DeepSeek's numerics: fp32 pooling, entries quantized where stored
        for rows, tokens in ((1, 1), (64, 1), (1, flash["prefill_tokens"])):
            out.append(("v4-flash", f"compressor {kind} fp32 fp8 {rows}x{tokens}",
                        compressor_launches(flash, kind, rows, tokens, fp8=True, fp32=True)))
    for rows, tokens in ((1, 1), (64, 1), (1, flash["prefill_tokens"])):
        out.append(("v4-flash", f"compressors csa+indexer fp32 fp8 {rows}x{tokens}", pair_compress_launches(
            compressor_launches(flash, "csa", rows, tokens, fp8=True, fp32=True),
            compressor_launches(flash, "indexer", rows, tokens, fp8=True, fp32=True))))
    for t in (1, flash["prefill_tokens"]):
        out.append(("v4-flash", f"indexer fp4 keys T={t}", indexer_launches(flash, t, True)))
        pool = _meta(4096, flash["page_size"], kv_fp8_entry_bytes(flash["head_dim"], flash["rope_dim"]),
                     dtype=torch.uint8)
        out.append(("v4-flash", f"store kv fp8 N={t}", plan_store_kv_fp8(
            _meta(t, flash["head_dim"]), pool, _meta(t, dtype=torch.int64), flash["rope_dim"])))
        keys = _meta(4096, flash["page_size"], indexer_fp4_entry_bytes(flash["index_head_dim"]), dtype=torch.uint8)
        out.append(("v4-flash", f"store indexer fp4 N={t}", plan_store_indexer_fp4(
            _meta(t, flash["index_head_dim"]), keys, _meta(t, dtype=torch.int64))))
    o_groups, o_rank = 8, 1024  # the attention output's grouped projection (o_a_proj), kept FP8
    o_in = flash["num_heads"] * flash["head_dim"] // o_groups
    o_a = Fp8Weight(_meta(o_groups * o_rank, o_in, dtype=torch.float8_e4m3fn),
                    _meta(o_groups * o_rank // 128, o_in // 128, dtype=torch.float32))
    for t in (1, 16, 64, 256, flash["prefill_tokens"]):
        out.append(("v4-flash", f"grouped fp8 o_a T={t}", plan_grouped_linear(_meta(t, o_groups, o_in), o_a)[1]))
    compressors = 2 * 2 * (flash["head_dim"] + flash["index_head_dim"])  # a CSA layer's kv and gate, main + indexer
    for t in (1, 16, 64, 256, flash["prefill_tokens"]):  # DeepSeek's numerics: fp32 products of bf16 weights
        for name, n, x_dtype in (("router", flash["num_experts"], torch.float32),
                                 ("lm head", flash["vocab"], torch.float32),
                                 ("compressors", compressors, torch.bfloat16)):
            if name == "compressors" or t < flash["prefill_tokens"]:
                out.append(("v4-flash", f"fp32 linear {name} T={t}", plan_fp32_linear(
                    _meta(t, flash["hidden"], dtype=x_dtype), _meta(n, flash["hidden"]))[1]))
    for t in (1, 256, flash["prefill_tokens"]):  # DeepSeek's numerics: the experts' inputs, the indexer's queries
        out.append(("v4-flash", f"round activations T={t}", plan_round(_meta(t, flash["hidden"]), fp4=False)[1]))
        queries = _meta(t, flash["index_heads"], flash["index_head_dim"])
        out.append(("v4-flash", f"round indexer queries T={t}", plan_round(queries, fp4=True)[1]))
    for fmt in ("fp8", "mxfp4"):
        for t in flash["moe_tokens"]:
            out.append(("v4-flash", f"moe {fmt} T={t}", moe_launches(flash, t, fmt)))
            out.append(("v4-flash", f"moe {fmt} deepseek T={t}", moe_launches(flash, t, fmt, deepseek=True)))
    for name, (n, k) in FP8_LINEARS.items():
        for t in (1, 16, 32, 64, 256, 4096):  # each variant fp8_gemm_config picks (swap-AB, split-K, act_quant ahead)
            out.append(("v4-flash", f"fp8 gemm {name} T={t}",
                        fp8_gemm_launches(t, n, k, FP8_PROLOGUES.get(name), FP8_HEAD_ROPES.get(name))))
    return out


def _specialise(kernel, args, kwargs):
    """What JITFunction.run would compile for these arguments: (signature, constexprs, attrs, options)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def _key(kernel, args, kwargs) -> str:
    signature, constexprs, attrs, options = _specialise(kernel, args, kwargs)
    return repr((kernel.fn.__name__, sorted(signature.items()), sorted(constexprs.items(), key=str),
                 sorted(attrs.items(), key=str), options.num_warps, options.num_stages))


def _cuobjdump(cubin: bytes, option: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(CUOBJDUMP), option, f.name], check=True, capture_output=True, text=True).stdout


def _resource_usage(cubin: bytes) -> dict:
    line = next(ln for ln in _cuobjdump(cubin, "-res-usage").splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in (field.split(":") for field in line.split() if ":" in field and "[" not in field)}


_WEIGHT_BYTES = {0: 2.0, 1: 1.0, 2: 0.5}  # per element, by the MoE kernels' WEIGHT_FORMAT (bf16, fp8, mxfp4)


def streamed_bytes_per_iteration(kernel, args, kwargs) -> float | None:
    """Bytes one program streams per iteration of its main loop: weights (FP8 GEMM, MoE) or keys (attention,
    indexer: the key tile, shared by the attention's head blocks, each of which reads it, so that counts per byte
    compare tiles); None for a kernel that streams neither."""
    name = kernel.fn.__name__
    if name in ("_fp8_gemm_kernel", "_grouped_fp8_kernel"):
        return kwargs["BLOCK_N"] * kwargs["BLOCK_K"]
    if name in ("_moe_gate_up_kernel", "_moe_down_kernel"):
        tiles = 2 if name == "_moe_gate_up_kernel" else 1  # gate and up
        return tiles * kwargs["BLOCK_N"] * kwargs["BLOCK_K"] * _WEIGHT_BYTES[kwargs["WEIGHT_FORMAT"]]
    names = dict(zip(kernel.arg_names, args))
    pool = names.get("comp_kv_ptr" if kwargs.get("COMP_MODE") else "window_kv_ptr", names.get("index_k_ptr"))
    rows = kwargs.get("BLOCK_N", kwargs.get("BLOCK_E"))
    if pool is None or rows is None:
        return None
    readers = -(-names["q_ptr"].shape[1] // kwargs["BLOCK_H"]) if "COMP_MODE" in kwargs else 1
    return rows * pool.shape[-1] * pool.element_size() / readers


def _loop_line(kernel, args, kwargs: dict, num_warps: int, cubin: bytes) -> str:
    """The main loop's profile, and the whole program's instruction count (what a kernel that reads its tile once,
    outside its loop, as the indexer its keys, issues for that tile too)."""
    sass = _cuobjdump(cubin, "-sass")
    streamed = streamed_bytes_per_iteration(kernel, args, kwargs)
    return (describe(loop_profile(sass), streamed / (32 * num_warps) if streamed else None)
            + f"; program {program_length(sass)} instr")


def decode_asm_problem(llir: str, asms: tuple[str, ...], what: str) -> str:
    """What is wrong with a kernel's decode asm (quant_formats.MXFP4_GROUP_ASM, FP4_PAIR_ASM, E4M3_PAIR_ASM) in its
    LLVM IR, "" if nothing: every instance must take each of its inputs twice, one word (and one multiplier
    register) twice (pack=2 over tensors joined with themselves), or the pair it writes would mix two words. An IR
    with no instance fails too (the kernel must decode through them)."""
    calls = [line for line in llir.splitlines() if any(asm in line for asm in asms)]
    operands = [re.findall(r"i32 (%[\w.]+)", line.rsplit('"', 1)[1]) for line in calls]
    mixed = sum(len(ops) not in (2, 4) or ops[0::2] != ops[1::2] for ops in operands)
    if not calls:
        return f"no {what} decode asm"
    return f"{mixed} of {len(calls)} {what} decode asm instances mix two words" if mixed else ""


def _decode_asm(kernel, kwargs: dict) -> tuple[tuple[str, ...], str] | None:
    """The decode asm a launch's kernel must hold on a GPU (bf16 tiles of MXFP4 experts, of FP4 keys whose entries
    are 4-byte aligned, or of the grouped o_a's e4m3 weights), and its name."""
    if kwargs.get("COMPUTE_DTYPE") != tl.bfloat16:
        return None
    if kwargs.get("WEIGHT_FORMAT") == 2:
        return MXFP4_GROUP_ASM, "MXFP4"
    if kwargs.get("KEYS_FP4") and kwargs["ALIGN"] % 4 == 0:
        return FP4_PAIR_ASM, "FP4 key"
    if kernel.fn.__name__ == "_grouped_fp8_kernel":
        return E4M3_PAIR_ASM, "e4m3"
    return None


def _compile(kernel, args, kwargs):
    signature, constexprs, attrs, options = _specialise(kernel, args, kwargs)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


_VARIANT_KWARGS = ("IS_SPLIT", "COMP_MODE", "SPLIT_K", "SWAP_AB", "PREQUANTIZED", "WEIGHT_FORMAT", "QUANTIZE_H")


def compile_case(index: int, sass: bool = False, config: Path | None = None) -> list[tuple[str, Compiled]]:
    """Compile the launches of case `index` (a worker process rebuilds the case list: launches hold kernels);
    sass: also profile each kernel's main loop; config: the plans read that tuned table."""
    if config is not None:
        tuning.load(config)
    model, case, launches = cases()[index]
    results = []
    for kernel, _grid, args, kwargs in launches:
        start = time.time()
        kwargs = {**kwargs, "PDL": True}  # as kernels.common.launch launches it with programmatic dependent launch on
        compiled = _compile(kernel, args, kwargs)
        options = compiled.metadata
        usage = _resource_usage(compiled.asm["cubin"])
        tiles = ",".join(f"{k}={v}" for k, v in kwargs.items() if k.startswith("BLOCK") or k in _VARIANT_KWARGS)
        config = f"{model} {case} [{tiles},warps={options.num_warps},stages={options.num_stages}]"
        loop = _loop_line(kernel, args, kwargs, options.num_warps, compiled.asm["cubin"]) if sass else ""
        decode = _decode_asm(kernel, kwargs)
        decode = decode_asm_problem(compiled.asm["llir"], *decode) if decode else ""
        results.append((_key(kernel, args, kwargs), Compiled(
            kernel=kernel.fn.__name__, config=config, registers=usage["REG"], shared=compiled.metadata.shared,
            spill_bytes=usage.get("STACK", 0) + usage.get("LOCAL", 0), wgmma="wgmma" in compiled.asm["ptx"],
            seconds=time.time() - start, loop=loop, decode_asm=decode,
            pdl=pdl_problem(compiled.asm["ptx"]))))
    return results


def _unique_cases(selected: list[int], all_cases) -> list[int]:
    """Drop cases whose launches all compile to kernels an earlier case already covers."""
    seen, keep = set(), []
    for i in selected:
        keys = {_key(k, a, kw) for k, _g, a, kw in all_cases[i][2]}
        if not keys <= seen:
            keep.append(i)
            seen |= keys
    return keep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="compile only the CI subset")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--config", type=Path, help="a tuned table (kernels/configs/<device>.json) the plans read")
    parser.add_argument("--sass", metavar="REGEX", help="only the cases whose 'model case' matches, each with what "
                        "its main loop issues per iteration and per byte it streams (weights or keys)")
    options = parser.parse_args()
    if options.config is not None:
        if not options.config.is_file():
            parser.error(f"--config {options.config}: no such file")
        tuning.load(options.config)
    if options.sass:
        try:
            re.compile(options.sass)
        except re.error as exc:
            parser.error(f"--sass {options.sass!r}: {exc}")

    all_cases = cases()
    selected = [i for i, (model, case, _) in enumerate(all_cases)
                if (not options.quick or (model, case) in QUICK)
                and (not options.sass or re.search(options.sass, f"{model} {case}"))]
    selected = _unique_cases(selected, all_cases)
    if not selected:  # (a pattern that matches nothing checked nothing: not a pass)
        parser.error(f"--sass {options.sass!r} matches no case (they are named 'model case', e.g. 'v4-flash moe ...')")
    start = time.time()
    compile_one = partial(compile_case, sass=bool(options.sass), config=options.config)
    if options.jobs > 1:
        with ProcessPoolExecutor(options.jobs) as pool:
            per_case = list(pool.map(compile_one, selected))
    else:
        per_case = [compile_one(i) for i in selected]
    rows, seen = [], set()
    for key, row in (r for results in per_case for r in results):
        if key not in seen:
            seen.add(key)
            rows.append(row)

    header = f"{'kernel':<32} {'regs':>4} {'shared':>8} {'spill':>5} {'wgmma':>5} {'s':>5}  config"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.kernel:<32} {r.registers:>4} {r.shared:>8} {r.spill_bytes:>5} {str(r.wgmma):>5} "
              f"{r.seconds:>5.1f}  {r.config}")
        if r.loop:
            print(f"{'':<32} loop: {r.loop}")
    problems = [r for r in rows if r.problem]
    print(f"\n{len(rows)} kernels compiled for sm_90 in {time.time() - start:.0f} s; "
          f"{len(problems)} with problems")
    for r in problems:
        print(f"FAIL {r.kernel}: {r.problem} ({r.config})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
