"""Bytes of a DeepSeek-V4 model's weights, from its config alone (no weight is read).

Formats:
- `published`: the checkpoint as DeepSeek ships it, with the mtp.* draft layer: FP8 e4m3 linears
  with one e8m0 byte per 128x128 block, routed experts in MXFP4 (half a byte per weight and one
  e8m0 byte per 32) or, with expert_dtype "fp8", in FP8 with float32 block scales;
  bf16 embeddings, head, norms, compressors, indexer weights_proj and router; fp32 mHC parameters,
  sinks, position biases and router bias; int64 tid2eid.
- `fp8`: what the engine holds with weight_format=fp8: as published (backend/model/checkpoint.py); the draft
  layer only when speculative decoding serves it;
- `dequantize`: what the engine holds with weight_format=dequantize: every weight in the engine dtype
  (bf16 on CUDA), the parameters the reference keeps in fp32 in fp32, tid2eid as int64; the draft
  layer only when served.
"""

from __future__ import annotations

from backend.model.checkpoint import expected_shapes, is_fp32_parameter
from backend.model.config import ModelConfig
from backend.model.quantization import FP8_BLOCK, MXFP4_BLOCK, ROUTED_EXPERTS, kept_quantized, published_format

FORMATS = ("published", "fp8", "dequantize")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for dim in shape:
        out *= dim
    return out


def _fp8_bytes(shape: tuple[int, ...], scale_bytes: int) -> int:
    *lead, n, k = shape
    blocks = -(-n // FP8_BLOCK) * -(-k // FP8_BLOCK)
    return _numel(tuple(lead)) * (n * k + blocks * scale_bytes)


# fp32 on disk (the published checkpoints keep norms in bf16; the engine holds those in fp32 too).
_FP32_ON_DISK = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias")


def tensor_bytes(name: str, shape: tuple[int, ...], config: ModelConfig, fmt: str, dtype_bytes: int = 2) -> int:
    """Bytes one engine tensor takes in `fmt` (see the module docstring)."""
    if name.endswith(".tid2eid"):
        return _numel(shape) * 8
    if fmt == "dequantize":
        return _numel(shape) * (4 if is_fp32_parameter(name) else dtype_bytes)
    if any(marker in name for marker in _FP32_ON_DISK):
        return _numel(shape) * 4
    stored = published_format(name, config)
    if stored is None or (fmt == "fp8" and not kept_quantized(name)):
        return _numel(shape) * 2
    if stored == "mxfp4":
        return _numel(shape) // 2 + _numel(shape) // MXFP4_BLOCK
    return _fp8_bytes(shape, scale_bytes=4 if name.endswith(ROUTED_EXPERTS) else 1)  # FP8 experts: float32 scales


def weight_bytes(config: ModelConfig, fmt: str, dtype_bytes: int = 2, layout=None,
                 draft_layers: int = 0, data_parallel: bool = False) -> dict[str, int]:
    """Bytes by part: embeddings + head, attention, routed experts, the rest, the draft layer (the published
    checkpoint's, or in the engine's formats the `draft_layers` speculative decoding serves); with a ParallelLayout
    (backend/model/parallel_layout.py), what one rank holds (split like the main layers'). `data_parallel`: the ranks
    run data-parallel attention (the layout splits the experts only), so each computes its own requests' logits with
    the whole LM head."""
    parts = dict.fromkeys(PARTS, 0)
    for part, _, _, size in _tensor_bytes_by_part(config, fmt, dtype_bytes, layout, draft_layers, data_parallel):
        parts[part] += size
    return parts


def experts_reached(num_experts: int, top_k: int, tokens: int) -> float:
    """The distinct experts `tokens` tokens reach when each picks `top_k` of `num_experts` uniformly, expected:
    E (1 - (1 - k / E)^B). k at one token, all E as B grows (V4-Flash's 256 top-6: 6 at 1, 81 at 16, 200 at 64)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def step_weight_bytes(config: ModelConfig, fmt: str, tokens: int, layout=None,
                      data_parallel: bool = False) -> dict[str, float]:
    """The bytes of weights a forward of `tokens` tokens (all ranks' under expert parallelism) must read, by part, as
    weight_bytes counts them (the draft layer not served): every tensor whole, but the routed experts' the fraction
    the tokens reach (`experts_reached`, uniform routing) and the tables read by token (the embedding, a hash
    layer's tid2eid) one row a token."""
    reached = experts_reached(config.n_routed_experts, config.num_experts_per_tok, tokens) / config.n_routed_experts
    parts = dict.fromkeys(PARTS, 0.0)
    for part, name, shape, size in _tensor_bytes_by_part(config, fmt, 2, layout, 0, data_parallel):
        if name.endswith(ROUTED_EXPERTS):
            size *= reached
        elif name == "model.embed_tokens.weight" or name.endswith(".tid2eid"):
            size *= min(1.0, tokens / shape[0])
        parts[part] += size
    return parts


def draft_pass_weight_bytes(config: ModelConfig, fmt: str, tokens: int, layout=None,
                            data_parallel: bool = False) -> float:
    """The bytes of weights one pass of the draft (MTP) layer over `tokens` tokens must read: the layer's tensors, of
    its routed experts the fraction the tokens reach, and the LM head it shares with the model (the draft's logits),
    and one embedding row a token."""
    reached = experts_reached(config.n_routed_experts, config.num_experts_per_tok, tokens) / config.n_routed_experts
    total = 0.0
    for part, name, shape, size in _tensor_bytes_by_part(config, fmt, 2, layout, 1, data_parallel):
        if part == "draft layer (mtp)":
            total += size * reached if name.endswith(ROUTED_EXPERTS) else size
        elif name == "lm_head.weight":
            total += size
        elif name == "model.embed_tokens.weight":
            total += size * min(1.0, tokens / shape[0])
    return total


PARTS = ("embed+head", "attention", "routed experts", "other", "draft layer (mtp)")


def _tensor_bytes_by_part(config: ModelConfig, fmt: str, dtype_bytes: int, layout, draft_layers: int,
                          data_parallel: bool):
    """(part, name, shape, bytes) of every tensor weight_bytes counts."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    # (the published files hold every MTP layer; the engine the ones speculative decoding serves)
    shapes = expected_shapes(config, config.num_nextn_predict_layers if fmt == "published" else draft_layers)
    if layout is not None:
        head = shapes["lm_head.weight"]
        shapes = layout.local_shapes(shapes)
        if data_parallel:
            shapes["lm_head.weight"] = head
    for name, shape in shapes.items():
        yield _part_of(name), name, shape, tensor_bytes(name, shape, config, fmt, dtype_bytes)


def _part_of(name: str) -> str:
    if name.startswith("model.mtp."):
        return "draft layer (mtp)"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embed+head"
    if name.endswith(ROUTED_EXPERTS):
        return "routed experts"
    return "attention" if ".self_attn." in name else "other"
