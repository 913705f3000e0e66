"""Random weights at a config's shapes and in its published formats, built on the device (load_format=dummy).

    weights = dummy_weights(model_config, dtype, device, weight_format, layout=layout, draft_layers=1)

What `load_weights` returns for DeepSeek's published checkpoint of the same config, without reading a file: the same
names, shapes, dtypes and kinds (tests/model/test_dummy_weights.py compares them with a real load). With a
quantization_config the FP8 linears are e4m3 with float32 power-of-two scales per 128 x 128 block (`Fp8Weight`) and
the routed experts MXFP4 (packed e2m1, e8m0 scales per 32) or FP8 (`QuantizedExperts`) where weight_format=fp8 keeps
them, every other weight in the engine dtype, fp32 where the reference keeps fp32, tid2eid int64; the
MTP layers when `draft_layers` asks for them. Under a ParallelLayout a rank builds only its own part, and refuses a
part a real load would refuse (FP8 cut off its block grid).

Each tensor is drawn on `device` in slices (no host copy, and no temporary larger than a slice), from a generator
seeded by (seed, name), and by the rank for a tensor split across ranks: the same seed gives the same weights, and a
replicated tensor is the same on every rank. The values are scaled as scripts/make_checkpoint.py scales its random
checkpoints (`init_scale`): activations stay O(1), the logits finite, router and indexer scores apart.
"""

from __future__ import annotations

import hashlib
import math

import torch

from backend.model.checkpoint import (check_quantized_parts, empty_quantized_experts, expected_shapes,
                                      is_fp32_parameter, weights_do_not_fit)
from backend.model.config import ModelConfig
from backend.model.parallel_layout import ParallelLayout
from backend.model.quantization import FP4_VALUES, ROUTED_EXPERTS, fp8_block_shape, kept_quantized, published_format
from kernels.fp8_gemm import Fp8Weight

_SLICE = 1 << 24  # values drawn at a time: a 64 MiB float32 temporary at most

# The root mean square of a uniformly random e2m1 code (the 16 of MXFP4, two zeros among them).
_FP4_RMS = math.sqrt(sum(v * v for v in FP4_VALUES) / len(FP4_VALUES))


def init_scale(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the random values of engine tensor `name`: fan-in scaled linears and experts, norms and mHC
    scales near 1, router weights large enough that their scores do not tie, large indexer weights (no near-tied
    top-k scores). The one rule for scripts/make_checkpoint.py's checkpoints and the dummy weights."""
    leaf = name.rsplit(".", 1)[-1]
    fixed = {"e_score_correction_bias": (0.0, 0.1), "sinks": (0.0, 1.0), "position_bias": (0.0, 0.5),
             "fn": (0.0, 0.1), "hc_fn": (0.0, 0.1), "base": (0.0, 0.5), "hc_base": (0.0, 0.5), "scale": (1.0, 0.1),
             "hc_scale": (1.0, 0.1)}
    if leaf in fixed:
        return fixed[leaf]
    if "norm" in name.rsplit(".", 2)[-2] or name == "model.norm.weight":
        return 1.0, 0.1
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if ".indexer." in name:
        return 0.0, 0.3
    if name.endswith("mlp.gate.weight"):
        return 0.0, 2.0 / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def dummy_weights(config: ModelConfig, dtype: torch.dtype, device, weight_format: str,
                  layout: ParallelLayout | None = None, draft_layers: int = 0, seed: int = 0) -> dict[str, object]:
    """This rank's engine tensors (the names of backend/model/checkpoint.expected_shapes), random (see above)."""
    parallel = layout or ParallelLayout()
    if weight_format == "fp8":
        check_quantized_parts(config, parallel, draft_layers)
    full = expected_shapes(config, draft_layers)
    weights = {}
    for name, shape in parallel.local_shapes(full).items():
        try:
            weights[name] = _dummy_tensor(config, name, shape, full[name], parallel, dtype, device, weight_format, seed)
        except torch.cuda.OutOfMemoryError:
            raise weights_do_not_fit("load_format=dummy: the weights", device, name, weights, config) from None
    return weights


def _dummy_tensor(config: ModelConfig, name: str, shape, full_shape, parallel: ParallelLayout, dtype, device,
                  weight_format: str, seed: int):
    """One tensor of `dummy_weights` (its rank's part of `full_shape`)."""
    split = parallel.shard(name, full_shape) is not None
    generator = _generator(f"{seed}:{name}" + (f":rank {parallel.rank}" if split else ""), device)
    stored = published_format(name, config)
    if stored and weight_format == "fp8" and kept_quantized(name):
        return _quantized(name, shape, full_shape[-1], stored, generator, device)
    if name.endswith(".tid2eid"):
        return _hash_routes(shape, config.n_routed_experts, generator, device)
    mean, std = init_scale(name, full_shape)
    return _normal(shape, mean, std, torch.float32 if is_fp32_parameter(name) else dtype, generator, device)


def _generator(key: str, device) -> torch.Generator:
    digest = hashlib.sha256(key.encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))


def _normal(shape, mean: float, std: float, dtype: torch.dtype, generator: torch.Generator, device) -> torch.Tensor:
    return _fill_normal(torch.empty(shape, dtype=dtype, device=device), mean, std, generator)


def _fill_normal(out: torch.Tensor, mean: float, std: float, generator: torch.Generator) -> torch.Tensor:
    """`out` (contiguous) filled with mean + std * N(0, 1) in its dtype, drawn a slice at a time on its device."""
    flat = out.view(-1)
    for start in range(0, flat.numel(), _SLICE):
        values = torch.randn(min(_SLICE, flat.numel() - start), generator=generator, device=out.device) * std
        flat[start:start + values.numel()] = values + mean if mean else values
    return out


def _power_of_two(x: float) -> float:
    return 2.0 ** round(math.log2(x))


def _quantized(name: str, shape, fan_in: int, stored: str, generator: torch.Generator, device):
    """A weight as published: e4m3 codes ~ N(0, 1) times a power-of-two scale near 1 / sqrt(fan-in) (FP8), or
    uniformly random e2m1 codes times such a scale (MXFP4): dequantized, about N(0, 1 / fan-in) either way. `fan_in`:
    the whole tensor's (a rank's part of a column-split weight is as scaled as the whole)."""
    if not name.endswith(ROUTED_EXPERTS):
        scale = torch.full(fp8_block_shape(shape), _power_of_two(fan_in ** -0.5), dtype=torch.float32, device=device)
        return Fp8Weight(_normal(shape, 0.0, 1.0, torch.float8_e4m3fn, generator, device), scale)
    halves = 2 if name.endswith("gate_up_proj") else 1
    experts = empty_quantized_experts(shape, torch.float8_e4m3fn if stored == "fp8" else torch.uint8, halves, device)
    if stored == "fp8":
        _fill_normal(experts.data, 0.0, 1.0, generator)
        experts.scale.fill_(_power_of_two(fan_in ** -0.5))
    else:
        experts.data.view(torch.uint8).random_(0, 256, generator=generator)  # two random e2m1 codes a byte
        experts.scale.fill_(127 + round(math.log2(1 / (_FP4_RMS * math.sqrt(fan_in)))))  # e8m0: 2^(byte - 127)
    return experts


def _hash_routes(shape, num_experts: int, generator: torch.Generator, device) -> torch.Tensor:
    """tid2eid [vocab, k]: k distinct experts per token, as the published table holds."""
    vocab, k = shape
    return torch.rand(vocab, num_experts, generator=generator, device=device).topk(k, dim=1).indices.to(torch.long)
