"""Bytes of a DeepSeek-V4 model's weights, from its config alone (no weight is read).

Formats:
- `published`: the checkpoint as DeepSeek ships it, with the mtp.* draft layer: FP8 e4m3 linears
  with one e8m0 byte per 128x128 block, routed experts in MXFP4 (half a byte per weight and one
  e8m0 byte per 32) or, with expert_dtype "fp8", in FP8 with float32 block scales;
  bf16 embeddings, head, norms, compressors, indexer weights_proj and router; fp32 mHC parameters,
  sinks, position biases and router bias; int64 tid2eid.
- `fp8`: what the engine holds with weight_format=fp8: as published, with `o_a_proj` dequantized to
  bf16 (backend/model/checkpoint.py); the draft layer only when speculative decoding serves it;
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
    (backend/parallel/layout.py), what one rank holds (split like the main layers'). `data_parallel`: the ranks run
    data-parallel attention (the layout splits the experts only), so each computes its own requests' logits with the
    whole LM head."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    parts = {"embed+head": 0, "attention": 0, "routed experts": 0, "other": 0, "draft layer (mtp)": 0}
    # (the published files hold every MTP layer; the engine the ones speculative decoding serves)
    shapes = expected_shapes(config, config.num_nextn_predict_layers if fmt == "published" else draft_layers)
    if layout is not None:
        head = shapes["lm_head.weight"]
        shapes = layout.local_shapes(shapes)
        if data_parallel:
            shapes["lm_head.weight"] = head
    for name, shape in shapes.items():
        size = tensor_bytes(name, shape, config, fmt, dtype_bytes)
        if name.startswith("model.mtp."):
            parts["draft layer (mtp)"] += size
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            parts["embed+head"] += size
        elif name.endswith(ROUTED_EXPERTS):
            parts["routed experts"] += size
        elif ".self_attn." in name:
            parts["attention"] += size
        else:
            parts["other"] += size
    return parts
