"""Checkpoint loading: sharded files, and clear errors for what the engine cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.model.config import UnsupportedCheckpoint, load_model_config, parse_model_config
from backend.model.checkpoint import CheckpointError, load_weights

from make_checkpoint import write_checkpoint


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same_tensors(tiny_checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    write_checkpoint(sharded, shard_bytes=256 * 1024)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 3 and (sharded / "model.safetensors.index.json").is_file()
    config = load_model_config(sharded)
    whole = load_weights(tiny_checkpoint, config, torch.float32, "cpu")
    shards = load_weights(sharded, config, torch.float32, "cpu")
    assert whole.keys() == shards.keys()
    assert all(torch.equal(whole[k], shards[k]) for k in whole)


def test_missing_tensor_names_it(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")


def test_misshaped_tensor_names_file_tensor_and_shapes(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][:, :, :-1].contiguous()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.experts.down_proj' "
                                              r"has shape \(8, 64, 31\), expected \(8, 64, 32\)"):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")


@pytest.mark.parametrize("change,message", [
    ({"quantization_config": {"quant_method": "fp8"}}, "FP8"),
    ({"model_type": "llama"}, "model_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
])
def test_unsupported_config_is_refused_clearly(tiny_checkpoint, tmp_path, change, message):
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpoint, match=message):
        load_model_config(ckpt)


def test_legacy_config_keys_mean_what_the_reference_reads(tiny_checkpoint, tmp_path):
    """compress_ratios / num_hash_layers / qk_rope_head_dim, as older configs ship them."""
    from transformers import DeepseekV4Config

    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "partial_rotary_factor"):
        raw.pop(key)
    raw.update(compress_ratios=[128, 4, 0, 4], num_hash_layers=2, qk_rope_head_dim=16)
    ckpt = tmp_path / "legacy"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(raw))
    ours = load_model_config(ckpt)
    theirs = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("transformers_version", "architectures")})
    assert ours.layer_types == theirs.layer_types
    assert ours.mlp_layer_types == theirs.mlp_layer_types
    assert ours.qk_rope_head_dim == theirs.qk_rope_head_dim == 16
    assert ours.rope_parameters == theirs.rope_parameters


def test_flash_shaped_variant_has_deepseek_v4_flash_widths():
    """--flash-shaped: the real widths (checked on the meta device, nothing is allocated)."""
    from make_checkpoint import make_config, parameter_shapes

    from backend.model.checkpoint import expected_shapes

    config = make_config(flash_shaped=True)
    shapes = parameter_shapes(config)
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"][0] == (256, 2 * 2048, 4096)
    assert shapes["model.layers.0.self_attn.q_b_proj.weight"][0] == (64 * 512, 1024)
    assert set(config.layer_types) == {"compressed_sparse_attention", "heavily_compressed_attention"}
    # The engine expects exactly the tensors the reference saves, with the same shapes.
    ours = expected_shapes(parse_model_config(json.loads(config.to_json_string())))
    assert ours == {name: shape for name, (shape, _) in shapes.items()}

