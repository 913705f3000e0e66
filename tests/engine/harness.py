"""Drive the engine's model step by step and compare it with the transformers reference.

The reference is `transformers.DeepseekV4ForCausalLM` run on the whole sequence at once. Besides
logits, both sides record the CSA indexer's top-k selection at every position of every CSA layer:
the selection is discontinuous, so where the two pick different entries the comparison must show
the choice was a near-tie rather than loosen its tolerance.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backend.memory.kv_manager import KVCacheManager, model_kv_layout
from backend.model.checkpoint import load_weights
from backend.model.config import load_model_config
from backend.model.deepseek_v4 import DeepseekV4Model
from backend.model.forward_batch import BatchRow, build_forward_batch
from backend.request import Sequence
from kernels.dispatch import KernelDispatch
from kernels.modes import Numerics

LOGITS_TOL = 1e-4
NEAR_TIE_REL = 1e-4  # a selection difference counts as a near-tie below this relative margin


class Reference:
    """The transformers model with hooks that record each CSA indexer's scores and selection.

    numerics="deepseek": DeepSeek's inference semantics, the numerical oracle of the engine's numerics=deepseek
    (fp32 deployments): transformers' model with the roundings DeepSeek's inference/model.py applies, at the
    same places, as hooks: each attention's K=V right after its kv_norm (the rope then turns only the trailing
    rope dims, which stay unrounded), each CSA/HCA compressor's entries right after theirs, and the indexer's
    keys and queries where they are scored (rotated, then e2m1). In fp32 the fp32 router and head change
    nothing. The roundings themselves are kernels/quant_formats.py's, checked against the formulas in
    tests/kernels/test_activation_quantizers.py. `noise` (with `seed`) multiplies every value about to be rounded by
    1 + noise * N(0, 1): how far another implementation's fp32 differences of that size can move the outputs
    (a value at a rounding boundary rounds the other way). `bf16_kv_cache`: the attention entries (window and
    compressed, after their rope) rounded to bf16 where they are cached, as in DeepSeek's bf16 KV cache: what an
    fp32 deployment's fp8 layout keeps of the rope values. On a quantized checkpoint (or with `quantized_linears`)
    the inputs of DeepSeek's FP8/FP4 linears are act_quant'ed (e4m3 per 128) and the experts apply the routing
    weight before their down projection, as DeepSeek's Linear and Expert do.
    """

    def __init__(self, checkpoint, numerics: str = "transformers", noise: float = 0.0, seed: int = 0,
                 bf16_kv_cache: bool = False, quantized_linears: bool | None = None):
        from transformers import DeepseekV4ForCausalLM
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

        self.model = DeepseekV4ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        self.config = self.model.config
        self._bf16_kv_cache = bf16_kv_cache
        self._records: dict[int, dict] = {}
        if numerics == "deepseek":  # (transformers drops a dequantized checkpoint's quantization_config: ours has it)
            if quantized_linears is None:
                quantized_linears = load_model_config(checkpoint).quantization_config is not None
            self._round_as_deepseek(noise, torch.Generator().manual_seed(seed), quantized_linears)
        for i, layer in enumerate(self.model.model.layers):
            for module in layer.modules():
                if isinstance(module, DeepseekV4Indexer):
                    module.register_forward_hook(self._indexer_hook(i))
                    module.scorer.register_forward_hook(self._scorer_hook(i))

    def _round_as_deepseek(self, noise: float, generator: torch.Generator, quantized: bool) -> None:
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4Attention,
                                                                          DeepseekV4CSACompressor,
                                                                          DeepseekV4Experts,
                                                                          DeepseekV4HCACompressor,
                                                                          DeepseekV4Indexer,
                                                                          DeepseekV4IndexerScorer, DeepseekV4MLP)

        from kernels.quant_formats import simulate_indexer_fp4, simulate_kv_fp8, simulate_quantization

        def nudged(x: torch.Tensor) -> torch.Tensor:
            return x * (1 + noise * torch.randn(x.shape, generator=generator)) if noise else x

        rope_dim = int(self.config.head_dim * self.config.partial_rotary_factor)

        def act_quant(x: torch.Tensor) -> torch.Tensor:  # an FP8/FP4 linear's input (quantized checkpoints)
            return simulate_quantization(nudged(x), 128, "e4m3") if quantized else x

        def quantize_input(module):
            module.register_forward_pre_hook(lambda m, args: (act_quant(args[0]), *args[1:]))

        for module in self.model.modules():
            if isinstance(module, (DeepseekV4Attention, DeepseekV4CSACompressor, DeepseekV4HCACompressor)):
                module.kv_norm.register_forward_hook(lambda m, args, out: simulate_kv_fp8(nudged(out), rope_dim))
            if isinstance(module, DeepseekV4Attention):
                for linear in (module.q_a_proj, module.q_b_proj, module.kv_proj, module.o_b_proj):
                    quantize_input(linear)
            elif isinstance(module, DeepseekV4Indexer):
                quantize_input(module.q_b_proj)
            elif isinstance(module, DeepseekV4MLP):  # the shared experts
                for linear in (module.gate_proj, module.up_proj, module.down_proj):
                    quantize_input(linear)
            elif isinstance(module, DeepseekV4Experts):
                module.forward = types.MethodType(_deepseek_experts_forward(act_quant), module)
            elif isinstance(module, DeepseekV4IndexerScorer):
                module.register_forward_pre_hook(lambda m, args: (
                    simulate_indexer_fp4(nudged(args[0])), simulate_indexer_fp4(nudged(args[1])), *args[2:]))

    def _indexer_hook(self, layer):
        def hook(module, args, output):
            self._records.setdefault(layer, {})["topk"] = output[0].clone()
        return hook

    def _scorer_hook(self, layer):
        def hook(module, args, output):
            self._records.setdefault(layer, {})["scores"] = output[0].clone()
        return hook

    @contextlib.contextmanager
    def _cached_entries_rounded(self):
        """While the model runs: apply_rotary_pos_emb's results that are attention entries (one K=V head of
        head_dim; queries have several heads, the indexer's keys another width) rounded to bf16."""
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

        if not self._bf16_kv_cache:
            yield
            return
        original, head_dim = modeling.apply_rotary_pos_emb, self.config.head_dim

        def rounded(x, cos, sin, *args, **kwargs):
            out = original(x, cos, sin, *args, **kwargs)
            is_entry = x.dim() == 4 and x.shape[1] == 1 and x.shape[-1] == head_dim
            return out.to(torch.bfloat16).to(out.dtype) if is_entry else out

        modeling.apply_rotary_pos_emb = rounded
        try:
            yield
        finally:
            modeling.apply_rotary_pos_emb = original

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, dict[int, dict]]:
        """Logits [S, V] of a full forward, and per CSA layer the scores [S, E] and top-k [S, k]."""
        self._records = {}
        with self._cached_entries_rounded():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        return logits, self._records

    @torch.no_grad()
    def greedy(self, ids: list[int], max_new_tokens: int, min_new_tokens: int = 0) -> list[int]:
        with self._cached_entries_rounded():
            return self._greedy(ids, max_new_tokens, min_new_tokens)

    def _greedy(self, ids: list[int], max_new_tokens: int, min_new_tokens: int) -> list[int]:
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  min_new_tokens=min_new_tokens, eos_token_id=self.config.eos_token_id,
                                  pad_token_id=self.config.eos_token_id)
        return out[0, len(ids):].tolist()


def _deepseek_experts_forward(act_quant):
    """transformers' DeepseekV4Experts.forward in DeepSeek's Expert.forward order: the routing weight multiplies the
    SwiGLU output before the down projection, whose input (and the experts') goes through act_quant."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        x = act_quant(hidden_states)
        for expert in range(self.num_experts):
            token_idx, top_k_pos = torch.where(top_k_index == expert)
            if token_idx.numel() == 0:
                continue
            current = self._apply_gate(F.linear(x[token_idx], self.gate_up_proj[expert]))
            current = act_quant(current * top_k_weights[token_idx, top_k_pos, None])
            final.index_add_(0, token_idx, F.linear(current, self.down_proj[expert]).to(final.dtype))
        return final
    return forward


@dataclass
class Tracked:
    seq: Sequence
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits
    selections: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (layer, position) -> entries


class EngineHarness:
    """The engine's model and pools without the scheduler: the test chooses every batch."""

    def __init__(self, checkpoint, page_size: int = 16, num_tokens: int = 16384, max_running_requests: int = 8,
                 swa_full_tokens_ratio: float = 0.5, kernel_mode: str = "auto", weight_format: str = "dequantize",
                 numerics: str = "transformers", dtype: torch.dtype = torch.float32,
                 kv_cache_dtype: str | None = None):
        """`numerics`: "transformers" or "deepseek"; `kv_cache_dtype` "fp8": DeepSeek's fp8 layout (else values)."""
        self.config = load_model_config(checkpoint)
        weights = load_weights(checkpoint, self.config, dtype, "cpu", weight_format)
        modes = Numerics.of(numerics, quantized_checkpoint=self.config.quantization_config is not None)
        self.model = DeepseekV4Model(self.config, weights, "cpu", dtype, KernelDispatch(kernel_mode, modes))
        self.kv = KVCacheManager(self.config, num_tokens=num_tokens, swa_full_tokens_ratio=swa_full_tokens_ratio,
                                 page_size=page_size, max_running_requests=max_running_requests,
                                 dtype=dtype, device="cpu",
                                 kv_layout=model_kv_layout(self.config, dtype, fp8=kv_cache_dtype == "fp8"),
                                 state_dtype=modes.compressor_dtype(dtype))
        self.model.indexer_observer = self._observe
        self._rows: list[Tracked] = []

    def _observe(self, layer, batch, scores, indices):
        for t in range(batch.num_tokens):
            tracked = self._rows[int(batch.token_seq[t])]
            chosen = {int(e) for e in indices[t] if e >= 0}
            tracked.selections[(layer, int(batch.positions[t]))] = chosen

    def step(self, work: list[tuple[Tracked, int]]) -> None:
        """One forward over (request, number of next tokens) rows; logits at every token are kept."""
        rows = []
        for tracked, n in work:
            seq = tracked.seq
            self.kv.extend(seq, n)
            start = seq.num_computed_tokens
            rows.append(BatchRow(seq.pages, seq.prompt_ids[start:start + n], start, True))
        batch = build_forward_batch(rows, self.kv, "cpu")
        batch.logits_token_index = torch.arange(batch.num_tokens)
        self._rows = [tracked for tracked, _ in work]
        logits = self.model.forward(batch, self.kv)
        for t in range(batch.num_tokens):
            self._rows[int(batch.token_seq[t])].logits[int(batch.positions[t])] = logits[t]
        for tracked, n in work:
            tracked.seq.num_computed_tokens += n
            self.kv.release_slid_out(tracked.seq)

    def free(self, tracked: Tracked) -> None:
        self.kv.free(tracked.seq)


@dataclass
class Comparison:
    positions_compared: int
    max_abs_diff: float
    near_ties: list[tuple[int, int, float]]  # (layer, position, relative margin)
    first_divergence: int | None


def selection_margin(scores: torch.Tensor, position: int, compress_rate: int, top_k: int) -> float | None:
    """Relative gap between the k-th and (k+1)-th causal score at `position` (None: nothing was cut)."""
    causal = (position + 1) // compress_rate
    row = scores[position, :causal].double()
    k = min(top_k, causal)
    if causal <= k:
        return None
    ordered = torch.sort(row, descending=True).values
    scale = max(ordered.abs().max().item(), 1e-30)
    return (ordered[k - 1] - ordered[k]).item() / scale


def compare(tracked: Tracked, ref_logits: torch.Tensor, ref_records: dict[int, dict], compress_rate: int,
            top_k: int, until: int | None = None) -> Comparison:
    """Selections must agree except at near-ties; logits must agree up to the first near-tie. `until`: only what comes
    before this position is held to that (where a rounding flip parted the two: test_deepseek_numerics.py)."""
    near_ties, divergence = [], None
    for (layer, pos), chosen in sorted(tracked.selections.items(), key=lambda kv: kv[0][1]):
        ref_chosen = {int(e) for e in ref_records[layer]["topk"][pos] if e >= 0}
        if chosen == ref_chosen or (until is not None and pos >= until):
            continue
        margin = selection_margin(ref_records[layer]["scores"], pos, compress_rate, top_k)
        assert margin is not None and margin < NEAR_TIE_REL, (
            f"layer {layer} position {pos}: engine picked {sorted(chosen)}, reference {sorted(ref_chosen)}, "
            f"and the scores are not a near-tie (relative margin {margin})")
        near_ties.append((layer, pos, margin))
        divergence = pos if divergence is None else min(divergence, pos)
    end = min(p for p in (divergence, until, float("inf")) if p is not None)
    compared = [p for p in tracked.logits if p < end]
    diffs = [(tracked.logits[p] - ref_logits[p]).abs().max().item() for p in compared]
    worst = max(diffs, default=0.0)
    assert worst <= LOGITS_TOL, f"logits differ by {worst:.3g} (> {LOGITS_TOL}) before any near-tie"
    return Comparison(len(compared), worst, near_ties, divergence)
