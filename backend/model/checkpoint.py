"""Checkpoint weights: the names and shapes DeepSeek-V4 expects, read with safetensors.

Names follow the Hugging Face layout that `transformers.DeepseekV4ForCausalLM` saves. Every
tensor is checked against the shape the config implies; a missing or misshaped tensor raises
`CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from backend.model.config import CSA, HCA, ModelConfig

# Parameters the reference keeps in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict).
_FP32_MARKERS = ("attn_hc.", "ffn_hc.", "hc_head.", "sinks", "position_bias", "e_score_correction_bias",
                 "q_a_norm.", "kv_norm.", "input_layernorm.", "post_attention_layernorm.", "model.norm.")


class CheckpointError(ValueError):
    """A checkpoint file is missing, or a tensor is missing, misshaped or of an unsupported dtype."""


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, n, heads, dh, q = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim, c.q_lora_rank
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, d),
        "lm_head.weight": (c.vocab_size, d),
        "model.norm.weight": (d,),
        "model.hc_head.hc_fn": (n, n * d),
        "model.hc_head.hc_base": (n,),
        "model.hc_head.hc_scale": (1,),
    }
    for i, layer_type in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.sinks": (heads,),
            p + "self_attn.q_a_proj.weight": (q, d),
            p + "self_attn.q_a_norm.weight": (q,),
            p + "self_attn.q_b_proj.weight": (heads * dh, q),
            p + "self_attn.kv_proj.weight": (dh, d),
            p + "self_attn.kv_norm.weight": (dh,),
            p + "self_attn.o_a_proj.weight": (c.o_groups * c.o_lora_rank, heads * dh // c.o_groups),
            p + "self_attn.o_b_proj.weight": (d, c.o_groups * c.o_lora_rank),
            p + "mlp.gate.weight": (e, d),
            p + "mlp.experts.gate_up_proj": (e, 2 * inter, d),
            p + "mlp.experts.down_proj": (e, d, inter),
            p + "mlp.shared_experts.gate_proj.weight": (inter, d),
            p + "mlp.shared_experts.up_proj.weight": (inter, d),
            p + "mlp.shared_experts.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        })
        for hc in ("attn_hc", "ffn_hc"):
            shapes.update({p + f"{hc}.fn": ((2 + n) * n, n * d), p + f"{hc}.base": ((2 + n) * n,), p + f"{hc}.scale": (3,)})
        if c.mlp_layer_types[i] == "hash_moe":
            shapes[p + "mlp.gate.tid2eid"] = (c.vocab_size, c.num_experts_per_tok)
        else:
            shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
        cp = p + "self_attn.compressor."
        if layer_type == HCA:
            shapes.update({cp + "position_bias": (c.hca_rate, dh), cp + "kv_proj.weight": (dh, d),
                           cp + "gate_proj.weight": (dh, d), cp + "kv_norm.weight": (dh,)})
        elif layer_type == CSA:
            di, hi = c.index_head_dim, c.index_n_heads
            shapes.update({cp + "position_bias": (c.csa_rate, 2 * dh), cp + "kv_proj.weight": (2 * dh, d),
                           cp + "gate_proj.weight": (2 * dh, d), cp + "kv_norm.weight": (dh,)})
            ip = cp + "indexer."
            shapes.update({ip + "position_bias": (c.csa_rate, 2 * di), ip + "kv_proj.weight": (2 * di, d),
                           ip + "gate_proj.weight": (2 * di, d), ip + "kv_norm.weight": (di,),
                           ip + "q_b_proj.weight": (hi * di, q), ip + "scorer.weights_proj.weight": (hi, d)})
    return shapes


def _weight_files(checkpoint: Path) -> dict[str, Path]:
    """Tensor name -> file, from model.safetensors.index.json or by listing the safetensors files."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint / fname for name, fname in weight_map.items()}
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint}")
    out = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})
    return out


def load_weights(checkpoint: str | Path, config: ModelConfig, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    from tqdm import tqdm

    checkpoint = Path(checkpoint)
    shapes = expected_shapes(config)
    files = _weight_files(checkpoint)
    missing = [name for name in shapes if name not in files]
    if missing:
        raise CheckpointError(f"{checkpoint}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(files[name], []).append(name)
    total_bytes = sum(p.stat().st_size for p in by_file)
    weights = {}
    with tqdm(total=len(shapes), desc="loading weights", unit="tensor", disable=total_bytes < 2**30) as bar:
        for path, names in by_file.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: file listed in the index does not exist")
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    weights[name] = _convert(name, f.get_tensor(name), shapes[name], path, dtype, device)
                    bar.update()
    return weights


def _convert(name: str, tensor: torch.Tensor, shape: tuple[int, ...], path: Path, dtype, device) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointError(f"{path}: tensor {name!r} is {tensor.dtype}; FP8 checkpoints are not supported yet")
    if not tensor.dtype.is_floating_point:
        return tensor.to(device=device, dtype=torch.long)
    target = torch.float32 if any(marker in name for marker in _FP32_MARKERS) else dtype
    return tensor.to(device=device, dtype=target).contiguous()
