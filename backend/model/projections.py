"""Linears that read the same input, multiplied as one GEMM.

A CSA layer's attention input x feeds seven linears (q_a, kv, the compressor's kv and gate, the
indexer compressor's kv and gate, the indexer's head weights); the shared expert's gate and up
read the MoE input. One launch per group instead of one per linear: the weights are concatenated
along their output rows once, at load, and each output is a column view of the product (no copy).

Weights concatenate only with their own kind: dense with dense, `Fp8Weight` with `Fp8Weight` when
every part's rows are a multiple of the 128-row scale block (otherwise the blocks would straddle two
weights). Each group keeps the order of its names, so the product equals the separate linears'.
Under numerics=deepseek on a quantized checkpoint some linears read their input act_quant'ed (DeepSeek's FP8
linears) and others the input as it is (the compressors', the indexer's head weights): they form separate groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8_gemm import Fp8Weight
from kernels.quant_formats import FP8_BLOCK

# Of the attention input's linears, those DeepSeek's inference multiplies as FP8 GEMMs on a quantized checkpoint,
# their input act_quant'ed (the others: the compressors' in fp32, the indexer's head weights in bf16).
QUANTIZED_ATTENTION_INPUT = frozenset({"self_attn.q_a_proj", "self_attn.kv_proj"})
ATTENTION_INPUT = ("self_attn.q_a_proj", "self_attn.kv_proj", "self_attn.compressor.kv_proj",
                   "self_attn.compressor.gate_proj", "self_attn.compressor.indexer.kv_proj",
                   "self_attn.compressor.indexer.gate_proj", "self_attn.compressor.indexer.scorer.weights_proj")
SHARED_EXPERT_INPUT = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")


@dataclass
class FusedProjection:
    groups: list[tuple[object, list[tuple[str, int]]]]  # (concatenated weight, [(name, rows)])
    quantized: list[bool]  # per group: reads the act_quant'ed input

    def __call__(self, x: torch.Tensor, linear, quantize=None) -> dict[str, torch.Tensor]:
        """name -> x @ weight(name)^T, a column view of its group's product; `quantize(x)` feeds the groups of
        quantized-input linears whose weights are not FP8 (None: x feeds every group)."""
        out, x_quantized = {}, None
        for (weight, parts), quantized in zip(self.groups, self.quantized):
            # an Fp8Weight's GEMM quantizes its input itself, as DeepSeek's act_quant (kernels/fp8_gemm.py)
            pre_quantize = quantized and quantize is not None and not isinstance(weight, Fp8Weight)
            if pre_quantize and x_quantized is None:
                x_quantized = quantize(x)
            product = linear(x_quantized if pre_quantize else x, weight)
            offset = 0
            for name, rows in parts:
                out[name] = product[..., offset:offset + rows]
                offset += rows
        return out

    def product(self, x: torch.Tensor, linear) -> torch.Tensor:
        """x @ [all weights]^T as one tensor (one launch when the weights form one group; x as given)."""
        products = [linear(x, weight) for weight, _ in self.groups]
        return products[0] if len(products) == 1 else torch.cat(products, dim=-1)


def fuse_projections(weights: dict, prefix: str, names: tuple[str, ...],
                     quantized_input: frozenset[str] = frozenset()) -> FusedProjection:
    """Take `prefix + name + '.weight'` for each present name out of `weights` into a FusedProjection; the names in
    `quantized_input` group apart, to read the act_quant'ed input."""
    present = [n for n in names if f"{prefix}{n}.weight" in weights]
    by_kind: dict[tuple[str, bool], list[tuple[str, object]]] = {}
    for name in present:
        w = weights.pop(f"{prefix}{name}.weight")
        by_kind.setdefault((_kind(w), name in quantized_input), []).append((name, w))
    groups, quantized = [], []
    for (kind, reads_quantized), members in by_kind.items():
        if kind == "fp8-unaligned":
            groups += [(w, [(name, w.shape[0])]) for name, w in members]
            quantized += [reads_quantized] * len(members)
            continue
        groups.append((_concatenate([w for _, w in members]), [(name, w.shape[0]) for name, w in members]))
        quantized.append(reads_quantized)
    return FusedProjection(groups, quantized)


def _kind(w) -> str:
    if isinstance(w, Fp8Weight):
        return "fp8" if w.shape[0] % FP8_BLOCK == 0 else "fp8-unaligned"
    return "dense"


def _concatenate(ws: list):
    if len(ws) == 1:
        return ws[0]
    if isinstance(ws[0], Fp8Weight):
        return Fp8Weight(torch.cat([w.data for w in ws]), torch.cat([w.scale for w in ws]))
    return torch.cat(ws)
