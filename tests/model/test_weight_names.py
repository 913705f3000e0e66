"""backend/model/weight_names.py: the one name table, checked against transformers itself."""

from __future__ import annotations

import json

import pytest
import torch
from make_checkpoint import make_config
from safetensors import safe_open

from backend.model.checkpoint import expected_shapes
from backend.model.config import parse_model_config
from backend.model.weight_names import Target, detect_layout, draft_layer_index, engine_target, original_name

EXPERT_TENSORS = (".experts.gate_up_proj", ".experts.down_proj")


def stored_names(shapes: dict, layout: str) -> dict[str, Target]:
    """Every name `layout` stores, with the engine tensor (part) it fills, via original_name."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(EXPERT_TENSORS):
            projs = ("w1", "w3") if name.endswith("gate_up_proj") else ("w2",)
            for expert in range(shape[0]):
                for proj in projs:
                    half = {"w1": "gate", "w3": "up"}.get(proj)
                    out[original_name(name, layout, expert, proj)] = Target(name, expert, half)
        else:
            out[original_name(name, layout)] = Target(name)
    return out


@pytest.fixture(scope="module")
def tiny_shapes(tiny_checkpoint):
    config = parse_model_config(json.loads((tiny_checkpoint / "config.json").read_text()))
    return expected_shapes(config, draft_layers=config.num_nextn_predict_layers)  # the MTP layer's names too


@pytest.mark.parametrize("layout", ["deepseek", "transformers"])
def test_every_engine_tensor_round_trips_through_each_layout(tiny_shapes, layout):
    for stored, target in stored_names(tiny_shapes, layout).items():
        assert engine_target(stored, layout) == target, stored


def test_the_transformers_layout_is_what_save_pretrained_writes(tmp_path):
    """The names transformers 5.23 writes for the tiny config, one tensor per expert, model. prefixed."""
    from transformers import DeepseekV4ForCausalLM

    config = make_config()
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        written = set(f.keys())
    shapes = expected_shapes(parse_model_config(config.to_dict()))
    assert written == set(stored_names(shapes, "transformers"))
    assert detect_layout(written) == "transformers"


def test_deepseek_published_names_map_to_the_engine():
    """Names as they appear in DeepSeek-V4-Flash's shards."""
    expected = {
        "embed.weight": Target("model.embed_tokens.weight"),
        "head.weight": Target("lm_head.weight"),
        "norm.weight": Target("model.norm.weight"),
        "hc_head_fn": Target("model.hc_head.hc_fn"),
        "layers.0.attn_norm.weight": Target("model.layers.0.input_layernorm.weight"),
        "layers.0.hc_ffn_scale": Target("model.layers.0.ffn_hc.scale"),
        "layers.0.attn.attn_sink": Target("model.layers.0.self_attn.sinks"),
        "layers.2.attn.wq_b.weight": Target("model.layers.2.self_attn.q_b_proj.weight"),
        "layers.2.attn.kv_norm.weight": Target("model.layers.2.self_attn.kv_norm.weight"),
        "layers.3.attn.compressor.ape": Target("model.layers.3.self_attn.compressor.position_bias"),
        "layers.3.attn.compressor.norm.weight": Target("model.layers.3.self_attn.compressor.kv_norm.weight"),
        "layers.2.attn.indexer.wq_b.weight": Target("model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"),
        "layers.2.attn.indexer.weights_proj.weight":
            Target("model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight"),
        "layers.2.attn.indexer.compressor.wgate.weight":
            Target("model.layers.2.self_attn.compressor.indexer.gate_proj.weight"),
        "layers.0.ffn.gate.tid2eid": Target("model.layers.0.mlp.gate.tid2eid"),
        "layers.5.ffn.gate.bias": Target("model.layers.5.mlp.gate.e_score_correction_bias"),
        "layers.5.ffn.shared_experts.w3.weight": Target("model.layers.5.mlp.shared_experts.up_proj.weight"),
        "layers.5.ffn.experts.7.w1.weight": Target("model.layers.5.mlp.experts.gate_up_proj", 7, "gate"),
        "layers.5.ffn.experts.7.w3.weight": Target("model.layers.5.mlp.experts.gate_up_proj", 7, "up"),
        "layers.5.ffn.experts.255.w2.weight": Target("model.layers.5.mlp.experts.down_proj", 255, None),
        # The MTP layer (V4-Flash: 1,575 tensors in its last shard), DeepSeek's MTPBlock's names.
        "mtp.0.e_proj.weight": Target("model.mtp.0.e_proj.weight"),
        "mtp.0.h_proj.weight": Target("model.mtp.0.h_proj.weight"),
        "mtp.0.enorm.weight": Target("model.mtp.0.enorm.weight"),
        "mtp.0.hnorm.weight": Target("model.mtp.0.hnorm.weight"),
        "mtp.0.norm.weight": Target("model.mtp.0.norm.weight"),
        "mtp.0.hc_head_fn": Target("model.mtp.0.hc_head.hc_fn"),
        "mtp.0.hc_head_scale": Target("model.mtp.0.hc_head.hc_scale"),
        "mtp.0.hc_attn_base": Target("model.mtp.0.attn_hc.base"),
        "mtp.0.attn_norm.weight": Target("model.mtp.0.input_layernorm.weight"),
        "mtp.0.attn.kv_norm.weight": Target("model.mtp.0.self_attn.kv_norm.weight"),
        "mtp.0.attn.attn_sink": Target("model.mtp.0.self_attn.sinks"),
        "mtp.0.ffn.gate.bias": Target("model.mtp.0.mlp.gate.e_score_correction_bias"),
        "mtp.0.ffn.experts.9.w2.weight": Target("model.mtp.0.mlp.experts.down_proj", 9, None),
    }
    for name, target in expected.items():
        assert engine_target(name, "deepseek") == target, name


def test_layouts_are_told_apart_by_their_names_and_the_draft_layer_is_recognised():
    assert detect_layout(["embed.weight", "layers.0.attn.wq_a.weight"]) == "deepseek"
    assert detect_layout(["model.embed_tokens.weight", "model.layers.0.attn.wq_a.weight", "head.weight"]) == \
        "transformers"
    assert detect_layout(["model.embed_tokens.weight", "model.layers.0.self_attn.q_a_proj.weight"]) == "hf-modules"
    with pytest.raises(ValueError, match="not a DeepSeek-V4 checkpoint"):
        detect_layout(["transformer.wte.weight"])
    assert draft_layer_index("mtp.0.attn.wq_a.weight") == 0 and draft_layer_index("model.mtp.1.enorm.weight") == 1
    assert draft_layer_index("layers.0.attn.wq_a.weight") is None


# DeepSeek-V4-Flash's MTP layer as its last shard (model-00046-of-00046.safetensors) holds it: name, shape, stored
# as ("fp8": e4m3 + e8m0 128x128 block scales, "fp4": int8 pairs + e8m0 scales per 32, else plain), from a public
# inventory of the published checkpoint (experts 0-255 each have w1, w2, w3).
PUBLISHED_FLASH_MTP = {
    "mtp.0.attn.attn_sink": ((64,), None), "mtp.0.attn.kv_norm.weight": ((512,), None),
    "mtp.0.attn.q_norm.weight": ((1024,), None), "mtp.0.attn.wkv.weight": ((512, 4096), "fp8"),
    "mtp.0.attn.wo_a.weight": ((8192, 4096), "fp8"), "mtp.0.attn.wo_b.weight": ((4096, 8192), "fp8"),
    "mtp.0.attn.wq_a.weight": ((1024, 4096), "fp8"), "mtp.0.attn.wq_b.weight": ((32768, 1024), "fp8"),
    "mtp.0.attn_norm.weight": ((4096,), None), "mtp.0.e_proj.weight": ((4096, 4096), "fp8"),
    "mtp.0.enorm.weight": ((4096,), None), "mtp.0.ffn.experts.0.w1.weight": ((2048, 2048), "fp4"),
    "mtp.0.ffn.experts.0.w2.weight": ((4096, 1024), "fp4"), "mtp.0.ffn.experts.255.w3.weight": ((2048, 2048), "fp4"),
    "mtp.0.ffn.gate.bias": ((256,), None), "mtp.0.ffn.gate.weight": ((256, 4096), None),
    "mtp.0.ffn.shared_experts.w1.weight": ((2048, 4096), "fp8"), "mtp.0.ffn.shared_experts.w2.weight": ((4096, 2048), "fp8"),
    "mtp.0.ffn.shared_experts.w3.weight": ((2048, 4096), "fp8"), "mtp.0.ffn_norm.weight": ((4096,), None),
    "mtp.0.h_proj.weight": ((4096, 4096), "fp8"), "mtp.0.hc_attn_base": ((24,), None),
    "mtp.0.hc_attn_fn": ((24, 16384), None), "mtp.0.hc_attn_scale": ((3,), None), "mtp.0.hc_ffn_base": ((24,), None),
    "mtp.0.hc_ffn_fn": ((24, 16384), None), "mtp.0.hc_ffn_scale": ((3,), None), "mtp.0.hc_head_base": ((4,), None),
    "mtp.0.hc_head_fn": ((4, 16384), None), "mtp.0.hc_head_scale": ((1,), None), "mtp.0.hnorm.weight": ((4096,), None),
    "mtp.0.norm.weight": ((4096,), None),
}


def test_the_published_mtp_layer_maps_onto_the_engines_draft_layer():
    """Every MTP tensor of V4-Flash's shard names an engine tensor of the draft layer with its shape (an expert's
    part of the merged tensor; an MXFP4 tensor holds two codes a byte), and every engine tensor is covered."""
    from pathlib import Path

    from backend.model.checkpoint import draft_layer_shapes

    config = parse_model_config(json.loads((Path(__file__).resolve().parents[2] / "docs" / "configs"
                                            / "deepseek-v4-flash.config.json").read_text()))
    shapes = draft_layer_shapes(config, 0)
    covered = set()
    for name, (stored, kind) in PUBLISHED_FLASH_MTP.items():
        target = engine_target(name, "deepseek")
        assert target.name in shapes, name
        covered.add(target.name)
        shape = shapes[target.name]
        if target.expert is not None:  # one expert's rows of gate_up (a half), or its down projection
            shape = (shape[1] // 2, shape[2]) if target.half else shape[1:]
        if kind == "fp4":
            shape = (shape[0], shape[1] // 2)
        assert stored == shape, (name, stored, shape)
    assert covered == set(shapes)
