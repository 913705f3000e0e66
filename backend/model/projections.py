"""Linears that read the same input, multiplied as one GEMM.

A CSA layer's attention input x feeds seven linears (q_a, kv, the compressor's kv and gate, the
indexer compressor's kv and gate, the indexer's head weights); the shared expert's gate and up
read the MoE input. One launch per group instead of one per linear: the weights are concatenated
along their output rows once, at load, and each output is a column view of the product (no copy).

Weights concatenate only with their own kind: dense with dense, `Fp8Weight` with `Fp8Weight` when
every part's rows are a multiple of the 128-row scale block (otherwise the blocks would straddle two
weights). Each group keeps the order of its names, so the product equals the separate linears'.
Under numerics=deepseek the linears read their input as DeepSeek's do: act_quant'ed (its FP8 linears, on a
quantized checkpoint), multiplied in fp32 (the compressors': DeepSeek upcasts their bf16 weights at load; here
`KernelDispatch.fp32_linear` reads them as published), or as it is (the indexer's head weights); each kind of input is
a group of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8_gemm import Fp8Weight
from kernels.quant_formats import FP8_BLOCK

# Of the attention input's linears, those DeepSeek's inference multiplies as FP8 GEMMs on a quantized checkpoint,
# their input act_quant'ed, and those it runs in fp32 (the compressors'; the indexer's head weights: as they are).
QUANTIZED_ATTENTION_INPUT = frozenset({"self_attn.q_a_proj", "self_attn.kv_proj"})
FP32_ATTENTION_INPUT = frozenset({"self_attn.compressor.kv_proj", "self_attn.compressor.gate_proj",
                                  "self_attn.compressor.indexer.kv_proj", "self_attn.compressor.indexer.gate_proj"})
PLAIN, QUANTIZED, FP32 = "plain", "quantized", "fp32"  # how a group reads its input
ATTENTION_INPUT = ("self_attn.q_a_proj", "self_attn.kv_proj", "self_attn.compressor.kv_proj",
                   "self_attn.compressor.gate_proj", "self_attn.compressor.indexer.kv_proj",
                   "self_attn.compressor.indexer.gate_proj", "self_attn.compressor.indexer.scorer.weights_proj")
SHARED_EXPERT_INPUT = ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")


@dataclass
class FusedProjection:
    groups: list[tuple[object, list[tuple[str, int]]]]  # (concatenated weight, [(name, rows)])
    inputs: list[str]  # per group: PLAIN, QUANTIZED (the act_quant'ed input) or FP32 (an fp32 product)

    def __call__(self, x: torch.Tensor, kernels, quantize=None, x_quantized=None) -> dict[str, torch.Tensor]:
        """name -> x @ weight(name)^T, a column view of its group's product (`kernels`: the model's KernelDispatch);
        `quantize(x)` feeds the QUANTIZED groups whose weights are not FP8 (an Fp8Weight's GEMM act_quants its input
        itself: kernels/fp8_gemm.py, or reads `x_quantized`, x's act_quant as its producer wrote it); the FP32 groups
        are fp32 products."""
        out, quantized = {}, None  # (the quantized input made once)
        for (weight, parts), kind in zip(self.groups, self.inputs):
            if kind == FP32:
                product = kernels.fp32_linear(x, weight)
            elif kind == QUANTIZED and quantize is not None and not isinstance(weight, Fp8Weight):
                quantized = quantize(x) if quantized is None else quantized
                product = kernels.linear(quantized, weight)
            elif kind == QUANTIZED and x_quantized is not None:
                product = kernels.linear(x, weight, x_quantized=x_quantized)
            else:
                product = kernels.linear(x, weight)
            offset = 0
            for name, rows in parts:
                out[name] = product[..., offset:offset + rows]
                offset += rows
        return out

    @property
    def quantizes_its_input(self) -> bool:
        """Every weight an Fp8Weight, whose GEMM act_quants its input itself."""
        return all(isinstance(weight, Fp8Weight) for weight, _ in self.groups)

    def product(self, x: torch.Tensor, linear) -> torch.Tensor:
        """x @ [all weights]^T as one tensor (one launch when the weights form one group; x as given)."""
        products = [linear(x, weight) for weight, _ in self.groups]
        return products[0] if len(products) == 1 else torch.cat(products, dim=-1)


def fuse_projections(weights: dict, prefix: str, names: tuple[str, ...], quantized_input: frozenset[str] = frozenset(),
                     fp32_input: frozenset[str] = frozenset()) -> FusedProjection:
    """Take `prefix + name + '.weight'` for each present name out of `weights` into a FusedProjection; the names in
    `quantized_input` group apart to read the act_quant'ed input, those in `fp32_input` (dense weights, kept as
    loaded) to be multiplied in fp32."""
    present = [n for n in names if f"{prefix}{n}.weight" in weights]
    by_kind: dict[tuple[str, str], list[tuple[str, object]]] = {}
    for name in present:
        w = weights.pop(f"{prefix}{name}.weight")
        reads = QUANTIZED if name in quantized_input else FP32 if name in fp32_input else PLAIN
        by_kind.setdefault((_kind(w), reads), []).append((name, w))
    groups, inputs = [], []
    for (kind, reads), members in by_kind.items():
        if kind == "fp8-unaligned":
            groups += [(w, [(name, w.shape[0])]) for name, w in members]
            inputs += [reads] * len(members)
            continue
        groups.append((_concatenate([w for _, w in members]), [(name, w.shape[0]) for name, w in members]))
        inputs.append(reads)
    return FusedProjection(groups, inputs)


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
