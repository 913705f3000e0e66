"""The switch between the Triton kernels and their torch references, one per engine.

    kernels = KernelDispatch("auto")   # Triton on CUDA tensors, the references elsewhere
    kernels.sparse_paged_attention(q, ...)

Modes: `auto` (the default); `reference` runs the references on CUDA too, for comparison (the
`use_reference_kernels` engine parameter, or DSV4_REFERENCE_KERNELS=1 when the mode is not
given); `triton` runs the kernels whatever the device — on CPU tensors that takes
TRITON_INTERPRET=1, which is how the tests check the engine's calls into the kernels without a
GPU. The model calls only the methods below, so every hot path has one seam.

A dispatch carries the deployment's `Numerics` (kernels/modes.py) and applies them where the kernels take a mode
(the mHC mix, the experts, the entries stored into the KV pools, as the pools' `KVLayout` keeps them); the model
reads the rest of them from here.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from kernels.attention import sparse_paged_attention_reference
from kernels.common import launch
from kernels.compressor import CompressorRun, round_stored_entries
from kernels.fp8_gemm import Fp8Weight, fp8_gemm_reference
from kernels.indexer import indexer_scores_reference
from kernels.modes import KVLayout, Numerics
from kernels.moe import QuantizedExperts, Routing, fused_moe_reference
from kernels.quant_formats import simulate_kv_fp8

MODES = ("auto", "reference", "triton")
def default_mode(use_reference: bool = False) -> str:
    return "reference" if use_reference or os.environ.get("DSV4_REFERENCE_KERNELS", "0") == "1" else "auto"


class KernelDispatch:
    def __init__(self, mode: str = "auto", numerics: Numerics = Numerics()):
        if mode not in MODES:
            raise ValueError(f"kernel dispatch mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.numerics = numerics

    def use_triton(self, tensor: torch.Tensor) -> bool:
        return self.mode == "triton" or (self.mode == "auto" and tensor.is_cuda)

    def sparse_paged_attention(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.use_triton(q):
            from kernels.attention import sparse_paged_attention_triton

            return sparse_paged_attention_triton(q, *args, **kwargs)
        return sparse_paged_attention_reference(q, *args, **kwargs)

    def indexer_scores(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.use_triton(q):
            from kernels.indexer import indexer_scores_triton

            return indexer_scores_triton(q, *args, **kwargs)
        return indexer_scores_reference(q, *args, **kwargs)

    def fused_moe(self, x: torch.Tensor, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, *,
                  out_dtype: torch.dtype | None = None, x_quantized=None, routing: Routing | None = None,
                  first_expert: int = 0) -> torch.Tensor:
        """Routed experts; out_dtype=torch.float32 returns the kernel's fp32 accumulator (no cast launch). The
        numerics choose the routing weight's place and the act_quant of the down projection's input
        (kernels/moe.py's deepseek_order and quantize_hidden); x_quantized: x's act_quant as the collapse that wrote
        x wrote it (the kernels then need no launch for it; the reference rounds x itself, to the same values).
        routing (topk_ids and topk_weights None): the tokens are routed here too (at decode sizes by the kernels'
        alignment launch); first_expert: the ids are shifted by it (this rank's experts are 0..)."""
        order = dict(deepseek_order=self.numerics.routing_weight_first, quantize_hidden=self.numerics.act_quant)
        if self.use_triton(x):
            from kernels.moe import fused_moe_triton

            return fused_moe_triton(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, out_dtype=out_dtype,
                                    x_quantized=x_quantized, routing=routing, first_expert=first_expert, **order)
        if routing is not None:
            topk_ids, topk_weights = routing.reference()
        if first_expert:
            topk_ids = topk_ids - first_expert  # another rank's experts fall outside 0..E - 1: left out
        w_gate_up, w_down = (w.dequantize().to(x.dtype) if isinstance(w, QuantizedExperts) else w
                             for w in (w_gate_up, w_down))
        return fused_moe_reference(x, topk_ids, topk_weights, w_gate_up, w_down, swiglu_limit, out_dtype=out_dtype,
                                   **order)

    def linear(self, x: torch.Tensor, weight, *, swiglu_limit: float | None = None,
               rms_norm: tuple[torch.Tensor, float] | None = None, x_quantized=None,
               rope: tuple[torch.Tensor, torch.Tensor, int] | None = None, round_indexer: bool = False) -> torch.Tensor:
        """x @ weight^T: F.linear for a dense weight, the block-scaled FP8 GEMM for an Fp8Weight. Its input may be
        what a launch would compute of x (the prologue): the clamped SwiGLU of a gate|up x (swiglu_limit), or x's
        weighted RMSNorm (rms_norm: weight, eps); its output what a launch would compute of it (the epilogue): its
        heads of head_dim channels roped by (cos, sin) (rope: cos, sin, head_dim) and with round_indexer rounded as
        DeepSeek rounds an indexer query. The FP8 GEMM under Triton computes them as it loads x and stores its output,
        the values the `swiglu` or `norm_rope` kernel would have written; otherwise they run as launches of their
        own. x_quantized: x's act_quant as its producer wrote it, which the FP8 GEMM reads instead of quantizing x
        ahead (the reference rounds x); with a prologue, the act_quant of what it computes (`shared_linear_input`).
        x is [T, K] with an epilogue."""
        if isinstance(weight, Fp8Weight) and self.use_triton(x):
            from kernels.fp8_gemm import fp8_gemm_triton, takes_head_rope

            flat = x.reshape(-1, x.shape[-1])  # (a column view of a wider product is read in place)
            flat = flat if flat.stride(-1) == 1 else flat.contiguous()
            fused = rope is None or takes_head_rope(rope[2], weight.shape[0])
            out = fp8_gemm_triton(flat, weight.data, weight.scale, swiglu_limit=swiglu_limit, rms_norm=rms_norm,
                                  x_quantized=x_quantized if x.dim() == 2 else None, rope=rope if fused else None,
                                  round_indexer=round_indexer and fused)
            out = out.view(*x.shape[:-1], weight.shape[0])
            return out if fused else self.linear_output(out, rope, round_indexer)
        x = self.linear_input(x, swiglu_limit=swiglu_limit, rms_norm=rms_norm)
        if not isinstance(weight, Fp8Weight):
            out = F.linear(x, weight)
        else:
            out = fp8_gemm_reference(x.reshape(-1, x.shape[-1]), weight.data, weight.scale)
            out = out.view(*x.shape[:-1], weight.shape[0])
        return self.linear_output(out, rope, round_indexer)

    def linear_input(self, x: torch.Tensor, *, swiglu_limit: float | None = None,
                     rms_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """The input of a `linear` with that prologue, by its own launch (x itself without one)."""
        if swiglu_limit is not None:
            return self.swiglu(x, swiglu_limit)
        if rms_norm is not None:
            return self.norm_rope(x, *rms_norm)
        return x

    def shared_linear_input(self, x: torch.Tensor, *, swiglu_limit: float | None = None,
                            rms_norm: tuple[torch.Tensor, float] | None = None):
        """For several FP8 `linear`s of the same input and prologue: its act_quant (e4m3 values, scales) by one launch,
        their `x_quantized`, where each GEMM would act_quant it ahead (under Triton, from QUANTIZE_AHEAD_MIN_TOKENS
        tokens); else None (each quantizes in its registers; the reference rounds x)."""
        from kernels.fp8_gemm import QUANTIZE_AHEAD_MIN_TOKENS, act_quant_triton

        if not self.use_triton(x) or x.dim() != 2 or x.shape[0] < QUANTIZE_AHEAD_MIN_TOKENS:
            return None
        return act_quant_triton(x if x.stride(-1) == 1 else x.contiguous(), swiglu_limit=swiglu_limit,
                                rms_norm=rms_norm)

    def linear_output(self, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                      round_indexer: bool = False) -> torch.Tensor:
        """The output [T, N] of a `linear` with that epilogue, by the norm_rope kernel's launch (out without one)."""
        if rope is None:
            return out
        cos, sin, head_dim = rope
        heads = self.norm_rope(out.view(out.shape[0], -1, head_dim), None, 0.0, normalize=False, cos=cos, sin=sin,
                               round_indexer=round_indexer)
        return heads.view(out.shape)

    def grouped_linear(self, x: torch.Tensor, weight) -> torch.Tensor:
        """x [T, G, K] by the G groups of weight [G * R, K] (the attention output's o_a_proj): [T, G * R]; an
        Fp8Weight is read as stored."""
        return self._fused("grouped_linear", "grouped_linear", x, x, weight)

    def fp32_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x.float() @ weight.float()^T in fp32 (DeepSeek's router and LM head), the weight read as it is stored."""
        return self._fused("fp32_linear", "fp32_linear", x, x, weight)

    # --- the fused kernels of one layer: `<name>_triton` or `<name>_reference` of kernels/<module>.py --------
    def _fused(self, module: str, name: str, tensor: torch.Tensor, *args, **kwargs):
        implementation = "triton" if self.use_triton(tensor) else "reference"
        return getattr(importlib.import_module(f"kernels.{module}"), f"{name}_{implementation}")(*args, **kwargs)

    def hc_collapse(self, streams, *args, **kwargs):
        """mHC collapse + the block's RMSNorm -> (post, comb, x)."""
        return self._fused("mhc", "hc_collapse", streams, streams, *args, **kwargs)

    def hc_mix(self, streams, *args):
        """mHC mix of one (or the sum of two) block outputs into the streams (in fp32 under DeepSeek's numerics)."""
        return self._fused("mhc", "hc_mix", streams, streams, *args, fp32_mix=self.numerics.fp32_mix)

    def hc_mix_collapse(self, streams, *args, quantize_x: bool = False, **kwargs):
        """hc_mix after a block, then hc_collapse before the next -> (new streams, post, comb, x); one launch at decode
        sizes. quantize_x: and x's act_quant (e4m3 values, scales) where the kernels that read x take it, under
        Triton; the references round x themselves, so none is made for them."""
        return self._fused("mhc", "hc_mix_collapse", streams, streams, *args, fp32_mix=self.numerics.fp32_mix,
                           quantize_x=quantize_x and self.use_triton(streams), **kwargs)

    def hc_head(self, streams, *args, **kwargs):
        return self._fused("mhc", "hc_head", streams, streams, *args, **kwargs)

    def norm_rope(self, x, *args, **kwargs):
        """RMSNorm and/or RoPE, optionally stored into a paged pool."""
        return self._fused("norm_rope", "norm_rope", x, x, *args, **kwargs)

    def compress_into_pool(self, kv, *args, **kwargs):
        """Close a compressor's windows into its pool and update its ring."""
        return self._fused("compressor", "compress_into_pool", kv, kv, *args, **kwargs)

    # --- DeepSeek's in-place activation quantizers (numerics=deepseek) --------------------------------------------
    def round_activations(self, x):
        """x as act_quant(inplace=True) leaves it: e4m3 per 128 columns, times the power-of-two scales."""
        return self._fused("act_rounding", "round_activations", x, x)

    def round_indexer(self, x):
        """Indexer vectors as DeepSeek's inference leaves them: rotated, then FP4 per 32, times the scales."""
        return self._fused("act_rounding", "round_indexer", x, x)

    # --- entries into the KV pools, as their layout keeps them and the numerics round them ------------------------
    def store_window_entries(self, kv, norm_weight, eps: float, cos, sin, pool, index, kv_layout: KVLayout) -> None:
        """Each token's K=V entry (normed, rotated) into slot `index` of the window pool, as `kv_layout` stores it (the
        fp8 layout: encoded by the kernel where it stores it)."""
        self.norm_rope(kv, norm_weight, eps, cos=cos, sin=sin, out=pool, out_index=index)
        rounding = self._rounding_of_stored(kv_layout, indexer=False)
        if rounding is not None:
            rows = pool.view(-1, pool.shape[-1])
            rows[index] = rounding(rows[index])

    def compress_and_store(self, runs: list[CompressorRun], kv_layout: KVLayout) -> None:
        """Run a layer's compressors (a CSA layer's and its indexer's, over one plan: one launch under Triton) and
        store the entries each closes into its pool as `kv_layout` keeps them: in the fp8 layout its attention
        entries, and the indexer's keys rotated and in FP4, encoded by the kernel where it stores them; in values,
        rounded after (DeepSeek's numerics)."""
        if self.use_triton(runs[0].kv):
            from kernels.compressor import pair_compress_launches, plan_compress_into_pool

            per_run = [run.run(plan_compress_into_pool) for run in runs]
            if len(runs) == 2 and runs[0].plan is runs[1].plan:
                per_run = [pair_compress_launches(*per_run)]
            launch([one for launches in per_run for one in launches])
        else:
            from kernels.compressor import compress_into_pool_reference

            for run in runs:
                run.run(compress_into_pool_reference)
        for run in runs:
            rounding = self._rounding_of_stored(kv_layout, run.keys)
            if rounding is not None:
                round_stored_entries(run.pool, run.plan, run.block_table, rounding)

    def _rounding_of_stored(self, kv_layout: KVLayout, indexer: bool):
        """What DeepSeek's numerics round a stored entry (an indexer key if `indexer`) to, applied after a pool of
        values stored it; None where nothing is rounded, or the fp8 layout's encoding is that rounding."""
        if kv_layout.fp8:
            return None
        if indexer:
            return self.round_indexer if self.numerics.round_indexer else None
        if not self.numerics.round_kv_entries:
            return None
        return lambda entries: simulate_kv_fp8(entries, kv_layout.rope_dim)

    def route(self, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids, topk_weights) of a `kernels.moe.Routing`: the routing kernel's launch, or the reference."""
        if not self.use_triton(routing.logits):
            return routing.reference()
        out, launches = routing.plan()
        launch(launches)
        return out

    def apply_token_bitmask(self, logits, bitmask, rows) -> None:
        """Structured outputs: -inf, in place, at the tokens each masked row's grammar does not allow."""
        self._fused("token_bitmask", "apply_token_bitmask", logits, logits, bitmask, rows)

    def swiglu(self, gate_up, limit: float):
        """The shared expert's clamped SwiGLU on its fused gate|up product."""
        return self._fused("moe", "swiglu", gate_up, gate_up, limit)
