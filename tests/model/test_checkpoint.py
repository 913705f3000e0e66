"""Checkpoint loading: sharded files, and clear errors for what the engine cannot load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from make_checkpoint import write_checkpoint
from safetensors.torch import load_file, save_file

from backend.model.checkpoint import CheckpointError, load_weights
from backend.model.config import UnsupportedCheckpoint, load_model_config, parse_model_config


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


def test_an_index_that_places_a_tensor_in_the_wrong_file_or_has_no_map_is_refused(tmp_path):
    """A shard index naming a file that does not hold the tensor fails before any weight is read, naming the file and
    the tensor (a safetensors error naming neither, midway through the load, before); an index without a
    weight_map is refused saying so."""
    sharded = tmp_path / "sharded"
    write_checkpoint(sharded, shard_bytes=256 * 1024)
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, first = next(iter(index["weight_map"].items()))
    other = next(f for f in index["weight_map"].values() if f != first)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    config = load_model_config(sharded)
    with pytest.raises(CheckpointError, match=f"{other}: the index places '{name}' in this file, which does not hold"):
        load_weights(sharded, config, torch.float32, "cpu")
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="has no weight_map object"):
        load_weights(sharded, config, torch.float32, "cpu")


def test_damaged_files_and_indexes_are_refused_naming_the_file(tmp_path):
    """A truncated shard, an index that is not JSON or maps a tensor to no file, a scale the index places in a file that
    lacks it, and a stale whole-model file beside shards without an index: each a CheckpointError naming the file
    before any weight is read (bare safetensors/JSON errors naming nothing, or a silent choice of copy, before)."""
    ckpt = tmp_path / "ds"
    write_checkpoint(ckpt, layout="deepseek", quantize="fp8-mxfp4", shard_bytes=64 * 1024)
    config = load_model_config(ckpt)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())

    def refused(message):
        with pytest.raises(CheckpointError, match=message):
            load_weights(ckpt, config, torch.float32, "cpu")

    index_path.write_text("{not json")
    refused(f"{index_path}: not a JSON object")
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], "embed.weight": None}}))
    refused(r"weight_map\['embed.weight'\] is None, not a file name")
    scale, weight_file = "layers.0.attn.wq_a.scale", index["weight_map"]["layers.0.attn.wq_a.weight"]
    elsewhere = next(f for f in index["weight_map"].values() if f != index["weight_map"][scale])
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], scale: elsewhere}}))
    refused(f"{elsewhere}: the index places '{scale}' in this file, which does not hold it")
    index_path.write_text(json.dumps(index))
    shard = ckpt / weight_file
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    refused(f"{shard}: not a readable safetensors file")
    shard.write_bytes(whole)
    merged = {}
    for path in sorted(set(index["weight_map"].values())):
        merged.update(load_file(ckpt / path))
    save_file(merged, ckpt / "model.safetensors")  # an old single-file copy left beside the shards
    load_weights(ckpt, config, torch.float32, "cpu")  # the index says which file holds what
    index_path.unlink()
    refused(r"and model.safetensors both hold '.*'.*every \*.safetensors file is read")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_a_weight_stored_as_integers_is_refused(tiny_checkpoint, tmp_path, dtype):
    """A weight of an integer dtype without block scales would load as its integer parts: refused, naming it; the
    hash MoE's token table, which is integers, must be integers."""
    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.q_a_proj.weight"] = tensors["model.layers.0.self_attn.q_a_proj.weight"].to(dtype)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"q_a_proj.weight' is {dtype}, expected a floating-point dtype"):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")
    table = next(name for name in tensors if name.endswith("tid2eid"))
    tensors = load_file(tiny_checkpoint / "model.safetensors")
    tensors[table] = tensors[table].float()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="tid2eid' is torch.float32, expected an integer dtype"):
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
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8"}, "expert_dtype": "int4"}, "expert_dtype"),
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
    ours = parse_model_config(json.loads(config.to_json_string()))  # (and its MTP layer, which the reference skips)
    assert expected_shapes(ours, ours.num_nextn_predict_layers) == {name: shape for name, (shape, _) in shapes.items()}



# --- the published configs -------------------------------------------------------------------------

PUBLISHED_CONFIGS = Path(__file__).resolve().parents[2] / "docs" / "configs"  # as DeepSeek publishes them


@pytest.mark.parametrize("name, layers, first_two, hash_layers, q_rank, experts, expert_dtype", [
    ("deepseek-v4-flash", 43, "sliding_attention", 3, 1024, 256, "fp4"),
    ("deepseek-v4-flash-base", 43, "sliding_attention", 3, 1024, 256, "fp8"),
    ("deepseek-v4-pro", 61, "heavily_compressed_attention", 3, 1536, 384, "fp4"),
])
def test_published_configs_parse_as_the_reference_reads_them(name, layers, first_two, hash_layers, q_rank, experts,
                                                             expert_dtype):
    from transformers import DeepseekV4Config

    raw = json.loads((PUBLISHED_CONFIGS / f"{name}.config.json").read_text())
    ours = parse_model_config(raw, name)
    theirs = DeepseekV4Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert ours.num_hidden_layers == layers and ours.layer_types == theirs.layer_types
    assert ours.layer_types[:2] == [first_two] * 2 and len(ours.layer_types) == layers  # the MTP entry dropped
    assert ours.layer_types[2:4] == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert ours.mlp_layer_types == theirs.mlp_layer_types
    assert ours.mlp_layer_types.count("hash_moe") == hash_layers
    assert (ours.q_lora_rank, ours.o_lora_rank, ours.n_routed_experts) == (q_rank, 1024, experts)
    assert ours.qk_rope_head_dim == 64 and ours.rope_parameters == theirs.rope_parameters
    compress = ours.rope_parameters["compress"]
    assert (compress["rope_type"], compress["factor"], compress["original_max_position_embeddings"],
            compress["rope_theta"]) == ("yarn", 16, 65536, 160000)
    assert ours.rope_parameters["main"]["rope_type"] == "default"
    assert ours.expert_dtype == expert_dtype and ours.quantization_config["weight_block_size"] == [128, 128]
    assert ours.num_nextn_predict_layers == 1


def test_the_published_v4_flash_plan_matches_its_shards_on_disk():
    """DeepSeek-V4-Flash's 46 shards hold 159,609,485,896 bytes of tensors (the mtp layer included)."""
    from backend.model.footprint import weight_bytes

    config = parse_model_config(json.loads((PUBLISHED_CONFIGS / "deepseek-v4-flash.config.json").read_text()))
    total = sum(weight_bytes(config, "published").values())
    assert abs(total - 159_609_485_896) / 159_609_485_896 < 0.02


# --- every layout, every published format ------------------------------------------------------------


def _reference_state(checkpoint) -> dict[str, torch.Tensor]:
    """What transformers itself loads from `checkpoint` (it dequantizes FP8/MXFP4 on CPU), in fp32."""
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).state_dict()


@pytest.mark.parametrize("layout", ["deepseek", "transformers"])
def test_unquantized_layouts_load_the_same_tensors_as_the_module_layout(tiny_checkpoint, tmp_path, layout):
    ckpt = tmp_path / layout
    write_checkpoint(ckpt, layout=layout, shard_bytes=200 * 1024)  # sharded: experts spread over files
    config = load_model_config(ckpt)
    ours = load_weights(ckpt, config, torch.float32, "cpu")
    built_in = load_weights(tiny_checkpoint, config, torch.float32, "cpu")
    assert ours.keys() == built_in.keys() and all(torch.equal(ours[k], built_in[k]) for k in ours)


@pytest.mark.parametrize("layout, quantize", [("deepseek", "fp8-mxfp4"), ("deepseek", "fp8"),
                                              ("transformers", "fp8-mxfp4")])
def test_quantized_checkpoints_load_exactly_what_transformers_dequantizes(tmp_path, layout, quantize):
    ckpt = tmp_path / f"{layout}-{quantize}"
    write_checkpoint(ckpt, layout=layout, quantize=quantize, shard_bytes=300 * 1024)
    config = load_model_config(ckpt)
    assert config.expert_dtype == ("fp4" if quantize == "fp8-mxfp4" else "fp8")
    ours = load_weights(ckpt, config, torch.float32, "cpu")
    theirs = _reference_state(ckpt)
    assert ours.keys() == theirs.keys()
    differ = [k for k in ours if not torch.equal(ours[k].float(), theirs[k].float())]
    assert not differ, differ[:5]


def test_the_published_layout_in_fp8_and_mxfp4_serves_what_the_reference_computes(tmp_path):
    """Logits at every position of a prefill, and greedy tokens, against transformers loading the same files."""
    from tests.engine.harness import EngineHarness, Reference, Tracked, compare

    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from backend.request import SamplingParams, Sequence

    ckpt = tmp_path / "flash-like"
    write_checkpoint(ckpt, layout="deepseek", quantize="fp8-mxfp4")
    harness, reference = EngineHarness(ckpt), Reference(ckpt)
    prompt = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    tracked = Tracked(Sequence("p", prompt))
    harness.step([(tracked, 170)])
    harness.step([(tracked, 130)])
    ref_logits, ref_records = reference.run(prompt)
    result = compare(tracked, ref_logits, ref_records, harness.config.csa_rate, harness.config.index_topk)
    assert result.positions_compared >= 0.9 * len(prompt)
    engine = LLMEngine(EngineConfig(checkpoint=str(ckpt), device="cpu"))
    got = engine.generate([prompt[:40], prompt], SamplingParams(max_tokens=12))
    assert [r["output_ids"] for r in got] == [reference.greedy(prompt[:40], 12), reference.greedy(prompt, 12)]


def _deepseek_checkpoint(tmp_path, quantize="fp8-mxfp4"):
    ckpt = tmp_path / "ds"
    write_checkpoint(ckpt, layout="deepseek", quantize=quantize)
    return ckpt, load_file(ckpt / "model.safetensors")


def test_the_draft_layer_is_loaded_when_served_and_skipped_with_one_log_line_otherwise(tmp_path, tiny_checkpoint,
                                                                                        caplog):
    import logging

    ckpt, tensors = _deepseek_checkpoint(tmp_path)  # FP8 e_proj/h_proj and attention, MXFP4 experts, as published
    stored = [name for name in tensors if name.startswith("mtp.")]
    assert "mtp.0.e_proj.scale" in stored and "mtp.0.ffn.experts.7.w2.weight" in stored
    with caplog.at_level(logging.INFO, logger="backend.model.checkpoint"):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")
    assert [r.getMessage() for r in caplog.records if "mtp" in r.getMessage()] == [
        f"loaded {ckpt} (deepseek layout): {len(expected_shapes_of(ckpt))} tensors; skipped the {len(stored)} "
        "tensors of mtp.* draft layers not served"]
    # Served: the same MTP tensors from DeepSeek's quantized layout as from the built-in checkpoint's module names
    # (which holds the values the quantized files were made from, up to their quantization).
    config = load_model_config(ckpt)
    served = load_weights(ckpt, config, torch.float32, "cpu", draft_layers=1)
    plain = load_weights(tiny_checkpoint, load_model_config(tiny_checkpoint), torch.float32, "cpu", draft_layers=1)
    draft = {name for name in served if name.startswith("model.mtp.0.")}
    assert draft == {name for name in plain if name.startswith("model.mtp.0.")} and len(draft) == 31
    assert torch.equal(served["model.mtp.0.hc_head.hc_fn"], plain["model.mtp.0.hc_head.hc_fn"])
    e_proj = plain["model.mtp.0.e_proj.weight"]
    assert (served["model.mtp.0.e_proj.weight"] - e_proj).abs().max() <= 0.07 * e_proj.abs().max()  # e4m3


def expected_shapes_of(ckpt):
    from backend.model.checkpoint import expected_shapes

    return expected_shapes(load_model_config(ckpt))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.0.attn.wq_a.scale"), r"FP8 tensor 'layers.0.attn.wq_a.weight' has no block scales"),
    (lambda t: t.update({"layers.0.attn.wq_a.scale": t["layers.0.attn.wq_a.scale"][:, :0]}),
     r"FP8 block scales 'layers.0.attn.wq_a.scale' have shape \(1, 0\), expected \(1, 1\)"),
    (lambda t: t.update({"layers.2.ffn.experts.3.w2.weight": t["layers.2.ffn.experts.3.w2.weight"][:, :8].clone()}),
     r"MXFP4 tensor 'layers.2.ffn.experts.3.w2.weight' has shape \(64, 8\), expected \(64, 16\)"),
    (lambda t: t.update({"layers.2.ffn.experts.3.w2.scale": t["layers.2.ffn.experts.3.w2.scale"][:2].clone()}),
     r"MXFP4 scales 'layers.2.ffn.experts.3.w2.scale' have shape \(2, 1\), expected \(64, 1\)"),
    (lambda t: [t.pop(f"layers.1.ffn.experts.5.w3.{leaf}") for leaf in ("weight", "scale")],
     r"'model.layers.1.mlp.experts.gate_up_proj' got 15 of its 16"),
    (lambda t: t.pop("layers.1.ffn.experts.5.w3.weight"),
     r"block scales 'layers.1.ffn.experts.5.w3.scale' without their weight"),
    (lambda t: t.update({"layers.0.attn.bogus.weight": torch.ones(2)}), r"unexpected tensor 'layers.0.attn.bogus.weight'"),
    (lambda t: t.update({"layers.0.attn.wq_b.weight": t["layers.0.attn.wq_b.weight"][:-1].clone()}),
     r"FP8 tensor 'layers.0.attn.wq_b.weight' has shape \(255, 48\), expected \(256, 48\)"),
    # FP8 codes a converter upcast without applying their scales, which it left beside them (512x the weights, once)
    (lambda t: t.update({"layers.2.ffn.shared_experts.w2.weight": t["layers.2.ffn.shared_experts.w2.weight"].to(
        torch.bfloat16)}), r"'layers.2.ffn.shared_experts.w2.weight' is BF16 beside block scales"),
    (lambda t: t.update({"layers.0.attn.wq_a.scale": t["layers.0.attn.wq_a.scale"].view(torch.uint8).to(torch.int32)}),
     r"scales 'layers.0.attn.wq_a.scale' are torch.int32; those of torch.float8_e4m3fn weights are e8m0"),
    (lambda t: t.update({"layers.2.ffn.experts.3.w2.scale": t["layers.2.ffn.experts.3.w2.scale"].float()}),
     r"scales 'layers.2.ffn.experts.3.w2.scale' are torch.float32; those of torch.int8 weights are e8m0 "
     r"\(float8_e8m0fnu or uint8\)$"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"] + 8}),
     r"'model.layers.0.mlp.gate.tid2eid' holds expert ids 8\.\.15; the layer has experts 0\.\.7"),
    (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"] - 1}),
     r"'model.layers.0.mlp.gate.tid2eid' holds expert ids -1\.\."),
    (lambda t: t.update({"layers.0.attn.q_a_proj.weight": torch.zeros(64, 64)}),  # (another layout's name for wq_a)
     r"'layers.0.attn.wq_a.weight' and 'layers.0.attn.q_a_proj.weight' both fill the engine's "
     r"'model.layers.0.self_attn.q_a_proj.weight'"),
])
@pytest.mark.parametrize("weight_format", ["dequantize", "fp8"])
def test_broken_published_checkpoints_are_refused_naming_file_tensor_and_shapes(tmp_path, edit, message,
                                                                               weight_format):
    ckpt, tensors = _deepseek_checkpoint(tmp_path)
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu", weight_format)


# --- weight_format=fp8: kept as published ----------------------------------------------------------------


@pytest.mark.parametrize("quantize", ["fp8-mxfp4", "fp8"])
def test_fp8_format_keeps_the_published_weights_and_they_mean_the_dequantized_ones(tmp_path, quantize):
    from kernels.fp8_gemm import Fp8Weight
    from kernels.moe import QuantizedExperts
    from kernels.quant_formats import dequantize_fp8

    ckpt = tmp_path / quantize
    write_checkpoint(ckpt, layout="deepseek", quantize=quantize, shard_bytes=300 * 1024)
    config = load_model_config(ckpt)
    kept = load_weights(ckpt, config, torch.float32, "cpu", weight_format="fp8")
    expanded = load_weights(ckpt, config, torch.float32, "cpu")
    q_b = kept["model.layers.1.self_attn.q_b_proj.weight"]
    assert isinstance(q_b, Fp8Weight) and q_b.data.dtype == torch.float8_e4m3fn
    assert torch.equal(q_b.data.float() * q_b.scale.repeat_interleave(128, 0)[:q_b.shape[0]]
                       .repeat_interleave(128, 1)[:, :q_b.shape[1]], expanded["model.layers.1.self_attn.q_b_proj.weight"])
    o_a = kept["model.layers.1.self_attn.o_a_proj.weight"]  # kept FP8 too (DeepSeek's inference dequantizes it)
    assert isinstance(o_a, Fp8Weight)
    assert torch.equal(dequantize_fp8(o_a.data, o_a.scale), expanded["model.layers.1.self_attn.o_a_proj.weight"])
    experts = kept["model.layers.2.mlp.experts.gate_up_proj"]
    assert isinstance(experts, QuantizedExperts) and experts.format == ("mxfp4" if quantize == "fp8-mxfp4" else "fp8")
    for name in ("model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        assert torch.equal(kept[name].dequantize(), expanded[name])


def test_fp8_format_needs_a_quantized_checkpoint(tiny_checkpoint):
    from backend.config import ConfigError, EngineConfig
    from backend.engine import LLMEngine

    with pytest.raises(ConfigError, match="'weight_format'"):
        LLMEngine(EngineConfig(checkpoint=str(tiny_checkpoint), device="cpu", weight_format="fp8"))


def test_a_checkpoint_written_by_save_pretrained_loads_the_models_own_tensors(tmp_path):
    """The checkpoint a transformers user has: DeepseekV4ForCausalLM.save_pretrained, not our writer."""
    from make_checkpoint import make_config
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(make_config())
    model.save_pretrained(tmp_path)
    ours = load_weights(tmp_path, load_model_config(tmp_path), torch.float32, "cpu")
    theirs = model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].float()) for k in ours)


def test_a_model_loaded_from_module_names_and_saved_again_loads(tiny_checkpoint, tmp_path):
    """A transformers user's round trip: from_pretrained on the built-in checkpoint (transformers' module names), then
    save_pretrained, which writes the module names back but reverses kv_norm to norm."""
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    model.save_pretrained(tmp_path)
    saved = set(safe_open(str(tmp_path / "model.safetensors"), "pt").keys())
    assert "model.layers.0.self_attn.norm.weight" in saved and "model.norm.weight" in saved
    ours = load_weights(tmp_path, load_model_config(tmp_path), torch.float32, "cpu")
    theirs = model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k].float()) for k in ours)


# --- hf_overrides against what config.json already says ---------------------------------------------------


@pytest.mark.parametrize("override, precedes", [
    ({"rope_theta": 5000.0}, "rope_parameters"), ({"partial_rotary_factor": 0.25}, "rope_parameters"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope_parameters"),
    ({"compress_ratios": [128, 4, 0, 4]}, "layer_types"), ({"num_hash_layers": 1}, "mlp_layer_types"),
])
def test_an_override_that_config_json_would_shadow_is_refused_naming_the_key_to_override(tiny_checkpoint, override,
                                                                                        precedes):
    """The built-in checkpoint's config.json has the nested rope_parameters and explicit layer types, which the
    reference reads before the flat and legacy keys: an override of those alone would change nothing (or, for
    partial_rotary_factor, the KV layout's rope width and not the rotary tables)."""
    with pytest.raises(UnsupportedCheckpoint, match=f"sets '{next(iter(override))}'.*'{precedes}' takes precedence"):
        load_model_config(tiny_checkpoint, override)
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    load_model_config(tiny_checkpoint, {**override, precedes: None})  # overriding that key too is what it says
    assert raw[precedes] is not None


def test_flat_rope_overrides_apply_where_config_json_has_flat_keys_and_a_flat_yarn_dict_shadows_rope_scaling(
        tmp_path):
    config = load_model_config("docs/configs/deepseek-v4-flash.config.json", {"rope_theta": 5000.0})
    assert config.rope_parameters["main"]["rope_theta"] == 5000.0
    raw = json.loads(Path("docs/configs/deepseek-v4-flash.config.json").read_text())
    raw["rope_parameters"] = raw.pop("rope_scaling")  # (the same YaRN dict under the name that takes precedence)
    raw["compress_rate_csa"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_model_config(tmp_path, {"rope_theta": 5000.0}).rope_parameters["main"]["rope_theta"] == 5000.0
    with pytest.raises(UnsupportedCheckpoint, match="sets 'rope_scaling'.*'rope_parameters' takes precedence"):
        load_model_config(tmp_path, {"rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(UnsupportedCheckpoint, match="sets 'compress_rates'.*'compress_rate_csa' takes precedence"):
        load_model_config(tmp_path, {"compress_rates": {"compressed_sparse_attention": 8,
                                                        "heavily_compressed_attention": 128}})


@pytest.mark.parametrize("override, message", [
    ({"compress_rates": {"compressed_sparse_attention": 4}}, r"compress_rates\['heavily_compressed_attention'\]=None"),
    ({"compress_rate_hca": 0}, r"compress_rates\['heavily_compressed_attention'\]=0"),
    ({"compress_rate_csa": 2.5}, r"compress_rate_csa=2.5 is not of type int"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5, "partial_rotary_factor": 0.125}}},
     r"rope_parameters\['compress'\] rotates 8 dims, head_dim \* partial_rotary_factor 16"),
    # numbers inside nested values, which failed only at the rotary tables, after every weight was read
    ({"rope_parameters": {"main": {"rope_theta": "10000"}, "compress": {"rope_theta": 1.6e5}}},
     r"rope_parameters\['main'\].rope_theta='10000': must be a positive number"),
    ({"rope_parameters": {"main": {"rope_theta": 1e4, "partial_rotary_factor": 0.25},
                          "compress": {"rope_theta": 1.6e5, "rope_type": "yarn", "factor": "16"}}},
     r"rope_parameters\['compress'\].factor='16'"),
    ({"rope_parameters": {"main": {"rope_theta": 1e4, "partial_rotary_factor": "0.25"},
                          "compress": {"rope_theta": 1.6e5}}},
     r"rope_parameters\['main'\].partial_rotary_factor='0.25'"),
    ({"eos_token_id": ["1"]}, r"eos_token_id=\['1'\] is not of type int \| list\[int\] \| None"),
    ({"eos_token_id": [1, 512]}, r"eos_token_id 512 is not a token id of the vocabulary \[0, 512\)"),
    ({"bos_token_id": -1}, r"bos_token_id -1 is not a token id"),
])
def test_values_that_would_fail_later_are_refused_when_the_config_is_read(tiny_checkpoint, override, message):
    with pytest.raises(UnsupportedCheckpoint, match=message):
        load_model_config(tiny_checkpoint, override)


def test_yarn_without_its_original_length_defaults_to_max_position_embeddings_as_the_reference(tiny_checkpoint):
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from backend.model.rotary import Rotary

    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    ours = parse_model_config(raw)
    theirs = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in ("transformers_version", "architectures")})
    assert ours.rope_parameters["compress"]["original_max_position_embeddings"] == raw["max_position_embeddings"]
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu", layer_type="compress")
    rotary = Rotary(ours, "compress", "cpu")
    assert torch.equal(rotary.inv_freq, inv_freq) and rotary.scaling == scaling


def test_expert_dtype_inside_quantization_config_is_read_and_a_conflict_refused(tiny_checkpoint):
    raw = json.loads((tiny_checkpoint / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert parse_model_config({**raw, "quantization_config": quant}).expert_dtype == "fp4"
    assert parse_model_config({**raw, "quantization_config": {**quant, "expert_dtype": "fp8"}}).expert_dtype == "fp8"
    with pytest.raises(UnsupportedCheckpoint, match="expert_dtype='fp4' but quantization_config.expert_dtype='fp8'"):
        parse_model_config({**raw, "expert_dtype": "fp4", "quantization_config": {**quant, "expert_dtype": "fp8"}})


def test_layers_cut_by_hf_overrides_are_not_read_and_others_still_fail_before_any_weight(tmp_path, caplog):
    """{"num_hidden_layers": 2} on a 4-layer published checkpoint: layers 2-3 skipped (one log line), the first two
    loaded as without the cut; a stray tensor is refused before a weight is read, whichever shard holds it."""
    import logging

    ckpt, tensors = _deepseek_checkpoint(tmp_path)
    whole = load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")
    config = load_model_config(ckpt, {"num_hidden_layers": 2})
    with caplog.at_level(logging.INFO, logger="backend.model.checkpoint"):
        cut = load_weights(ckpt, config, torch.float32, "cpu")
    assert cut.keys() == {name for name in whole if not name.startswith(("model.layers.2.", "model.layers.3."))}
    assert all(torch.equal(cut[name], whole[name]) for name in cut)
    skipped = sum(1 for name in tensors if name.startswith(("layers.2.", "layers.3.")))
    assert f"skipped the {skipped} tensors of layers 2-3, cut by hf_overrides" in caplog.text
    tensors["layers.4.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"].clone()  # past the checkpoint's 4
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor 'layers.4.attn.wq_a.weight'"):
        load_weights(ckpt, config, torch.float32, "cpu")


def test_an_expert_in_another_format_is_refused_when_kept_as_published(tmp_path):
    """weight_format=fp8 merges each layer's experts into one tensor of one format: an MXFP4 expert among FP8 ones is
    refused naming it (a bare size error of a byte view, before). Dequantized, each expert is read in its own."""
    from backend.model.quantization import dequantize_fp8, dequantize_mxfp4, quantize_mxfp4

    ckpt, tensors = _deepseek_checkpoint(tmp_path, quantize="fp8")
    name = "layers.2.ffn.experts.3.w2"
    values = dequantize_fp8(tensors[f"{name}.weight"], tensors[f"{name}.scale"])
    tensors[f"{name}.weight"], tensors[f"{name}.scale"] = quantize_mxfp4(values)
    save_file(tensors, ckpt / "model.safetensors")
    config = load_model_config(ckpt)
    with pytest.raises(CheckpointError, match=rf"'{name}.weight' is torch.int8, while "
                                              r"'model.layers.2.mlp.experts.down_proj' holds fp8 experts"):
        load_weights(ckpt, config, torch.float32, "cpu", "fp8")
    loaded = load_weights(ckpt, config, torch.float32, "cpu")
    assert torch.equal(loaded["model.layers.2.mlp.experts.down_proj"][3], dequantize_mxfp4(*quantize_mxfp4(values)))


def test_running_out_of_device_memory_while_loading_says_what_to_change(tiny_checkpoint, monkeypatch):
    """Out of memory midway through a load: a ConfigError naming the tensor, what was loaded, and the settings that
    size it, with the weights loaded so far let go (torch's error, naming none of it, before). Faked on CPU."""
    from backend.errors import ConfigError
    from backend.model import checkpoint

    taken, take = [], checkpoint._Loader.take

    def take_until_full(self, name, f, path):
        if len(taken) == 5:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        taken.append(self)
        take(self, name, f, path)

    monkeypatch.setattr(checkpoint._Loader, "take", take_until_full)
    with pytest.raises(ConfigError, match=rf"the weights of {tiny_checkpoint} do not fit cpu: out of memory at \S+ "
                                          r"after 0\.\d GiB of tensors; fewer layers \(hf_overrides num_hidden_layers"):
        load_weights(tiny_checkpoint, load_model_config(tiny_checkpoint), torch.float32, "cpu")
    assert taken[0].weights == {}


def test_a_rank_split_off_the_block_grid_is_refused_when_the_deployment_is_planned(parallel_checkpoint_published):
    """TP=2 cuts o_a_proj's 128 FP8 rows in two: weight_format=fp8 cannot keep them. make_model_repository.py's
    check (check_deployment: no pool allocated, no worker started) refuses it, as the load would after the workers
    started."""
    from backend.config import EngineConfig
    from backend.deployment import check_deployment

    settings = dict(checkpoint=str(parallel_checkpoint_published), device="cpu", tensor_parallel_size=2)
    with pytest.raises(CheckpointError, match=r"o_a_proj.weight': this rank's part \[0, 64\) of dimension 0 is not on "
                                              r"the 128-wide block grid"):
        check_deployment(EngineConfig(weight_format="fp8", **settings))
    check_deployment(EngineConfig(weight_format="dequantize", **settings))


# --- the tokenizer and generation_config.json ---------------------------------------------------------------


def test_a_missing_or_foreign_tokenizer_is_refused_naming_the_file(tmp_path, tiny_checkpoint):
    from backend.errors import ConfigError
    from backend.engine_core import load_tokenizer

    with pytest.raises(ConfigError, match=rf"{tmp_path}/tokenizer.json: no such tokenizer file"):
        load_tokenizer(tmp_path, 512, built_in=False)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"{tmp_path}/tokenizer.json: not a tokenizer the tokenizers library reads"):
        load_tokenizer(tmp_path, 512, built_in=False)
    assert load_tokenizer(tiny_checkpoint, 512, built_in=False).get_vocab_size() <= 512
    with pytest.raises(ConfigError, match=r"the tokenizer has \d+ ids, the model's vocabulary only 300"):
        load_tokenizer(tiny_checkpoint, 300, built_in=False)
    load_tokenizer(tiny_checkpoint, 300, built_in=True)  # (standing in for a dummy model's: ids past it are left be)


def test_the_engine_refuses_a_checkpoint_without_its_tokenizer_before_making_its_pools(tiny_checkpoint, tmp_path,
                                                                                        monkeypatch):
    from backend import engine
    from backend.config import EngineConfig
    from backend.errors import ConfigError

    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "tokenizer.json").unlink()
    monkeypatch.setattr(engine, "plan_deployment", lambda *a: pytest.fail("pools planned before the tokenizer"))
    with pytest.raises(ConfigError, match="tokenizer.json: no such tokenizer file"):
        engine.LLMEngine(EngineConfig(checkpoint=str(ckpt), device="cpu"))


@pytest.mark.parametrize("generation, message", [
    ('{"eos_token_id": "1"}', r"generation_config.json: eos_token_id '1' is not a token id of the vocabulary"),
    ('{"eos_token_id": [1, 100000]}', r"eos_token_id 100000 is not a token id of the vocabulary \[0, 512\)"),
    ("{not json", r"generation_config.json: not readable JSON"),
    ("[1]", r"generation_config.json: must hold a JSON object, not list"),
])
def test_generation_config_eos_ids_are_checked(tiny_checkpoint, tmp_path, generation, message):
    """A string id never matched a sampled token: requests never stopped at their end."""
    from backend.config import EngineConfig
    from backend.engine_core import eos_token_ids
    from backend.errors import ConfigError

    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "generation_config.json").write_text(generation)
    config = EngineConfig(checkpoint=str(ckpt), device="cpu")
    with pytest.raises(ConfigError, match=message):
        eos_token_ids(config, load_model_config(ckpt))


def test_an_eos_override_wins_over_generation_config(tiny_checkpoint, tmp_path):
    from backend.config import EngineConfig
    from backend.engine_core import eos_token_ids

    ckpt = _copy(tiny_checkpoint, tmp_path / "c")
    (ckpt / "generation_config.json").write_text('{"eos_token_id": 1}')
    assert eos_token_ids(EngineConfig(checkpoint=str(ckpt)), load_model_config(ckpt)) == [1]
    overrides = {"eos_token_id": [7, 9]}
    config = EngineConfig(checkpoint=str(ckpt), hf_overrides=overrides)
    assert eos_token_ids(config, load_model_config(ckpt, overrides)) == [7, 9]


def test_quantized_files_under_a_config_without_quantization_config_are_loaded_with_a_warning(tmp_path, caplog):
    """The config decides the numerics and formats; files that are FP8/MXFP4 under a config that declares none are
    dequantized, and the log says so."""
    import logging

    ckpt, _ = _deepseek_checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="backend.model.checkpoint"):
        load_weights(ckpt, load_model_config(ckpt), torch.float32, "cpu")
    assert any("has no quantization_config, yet" in r.getMessage() for r in caplog.records)
