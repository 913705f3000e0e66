"""load_format=dummy: random weights at a config's shapes and published formats, no weight file read.

They must be what a real load of DeepSeek's published checkpoint of the same config gives (names, shapes, dtypes,
kinds: Fp8Weight / QuantizedExperts where weight_format=fp8 keeps them), per rank under a parallel layout; seeded;
and a model the engine serves: finite logits, routers whose scores do not tie, greedy decoding end to end, token ids
beyond the fallback tokenizer's vocabulary served without a crash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from make_checkpoint import write_checkpoint

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.model.checkpoint import CheckpointError, load_weights
from backend.model.config import load_model_config
from backend.model.dummy_weights import dummy_weights
from backend.model.parallel_layout import ParallelLayout
from backend.request import SamplingParams
from kernels.fp8_gemm import Fp8Weight
from kernels.moe import QuantizedExperts
from tests.conftest import TINY_FLASH_OVERRIDES

FLASH = Path(__file__).resolve().parents[2] / "docs" / "configs" / "deepseek-v4-flash.config.json"
TINY_FLASH = dict(TINY_FLASH_OVERRIDES, num_hidden_layers=4)


def describe(weights: dict) -> dict[str, tuple]:
    """Each tensor's kind, and the shape and dtype of each of its parts."""
    def parts(t):
        if isinstance(t, Fp8Weight):
            return "fp8", tuple(t.data.shape), t.data.dtype, tuple(t.scale.shape), t.scale.dtype
        if isinstance(t, QuantizedExperts):
            return (t.format, t.shape, t.rows_per_half, tuple(t.data.shape), t.data.dtype, tuple(t.scale.shape),
                    t.scale.dtype)
        return "tensor", tuple(t.shape), t.dtype
    return {name: parts(t) for name, t in weights.items()}


def _bytes(t) -> list[torch.Tensor]:
    """A weight's parts as raw bytes (float8 has no torch.equal)."""
    tensors = [t.data, t.scale] if isinstance(t, (Fp8Weight, QuantizedExperts)) else [t]
    return [x.contiguous().view(torch.uint8) if x.element_size() == 1 else x for x in tensors]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bytes(a), _bytes(b)))


@pytest.fixture(scope="module")
def fp8_experts_checkpoint(tmp_path_factory) -> Path:
    """V4-Flash-Base's formats: FP8 linears and FP8 experts, float32 scales."""
    out = tmp_path_factory.mktemp("dsv4-fp8-experts")
    write_checkpoint(out, seed=3, layout="deepseek", quantize="fp8")
    return out


LAYOUTS = {"one rank": ParallelLayout(), "EP=2 rank 1": ParallelLayout(1, 2, rank=1),
           "TP=2 rank 1": ParallelLayout(2, 1, rank=1), "DP=2+EP=2 rank 1": ParallelLayout(1, 2, 1, 2)}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("weight_format", ["dequantize", "fp8"])
@pytest.mark.parametrize("formats", ["fp8-mxfp4", "fp8"])
def test_dummy_weights_are_what_a_published_checkpoint_loads(parallel_checkpoint_published, fp8_experts_checkpoint,
                                                             formats, weight_format, layout):
    checkpoint = parallel_checkpoint_published if formats == "fp8-mxfp4" else fp8_experts_checkpoint
    config, parallel = load_model_config(checkpoint), LAYOUTS[layout]
    if weight_format == "fp8" and parallel.attention_split:  # o_b's 128 columns split in 2: off the block grid
        with pytest.raises(CheckpointError, match="block grid"):
            load_weights(checkpoint, config, torch.float32, "cpu", weight_format, parallel)
        with pytest.raises(CheckpointError, match="block grid"):
            dummy_weights(config, torch.float32, "cpu", weight_format, parallel)
        return
    real = load_weights(checkpoint, config, torch.bfloat16, "cpu", weight_format, parallel, draft_layers=1)
    dummy = dummy_weights(config, torch.bfloat16, "cpu", weight_format, parallel, draft_layers=1)
    assert describe(dummy) == describe(real)
    assert any(name.startswith("model.mtp.0.") for name in dummy)


def test_the_same_seed_gives_the_same_weights_and_ranks_share_what_they_replicate(parallel_checkpoint_published):
    config = load_model_config(parallel_checkpoint_published)
    first, again, other = (dummy_weights(config, torch.float32, "cpu", "fp8", ParallelLayout(1, 2, rank=0), seed=seed)
                           for seed in (0, 0, 1))
    assert all(_same(first[name], again[name]) for name in first)
    assert not any(_same(first[name], other[name]) for name in first if name.endswith(("weight", "gate_up_proj")))
    rank1 = dummy_weights(config, torch.float32, "cpu", "fp8", ParallelLayout(1, 2, rank=1))
    assert _same(rank1["model.layers.0.self_attn.q_a_proj.weight"], first["model.layers.0.self_attn.q_a_proj.weight"])
    assert _same(rank1["model.layers.0.mlp.gate.tid2eid"], first["model.layers.0.mlp.gate.tid2eid"])
    assert not _same(rank1["model.layers.2.mlp.experts.down_proj"], first["model.layers.2.mlp.experts.down_proj"])


def test_published_formats_hold_values_that_mean_fan_in_scaled_weights(parallel_checkpoint_published):
    config = load_model_config(parallel_checkpoint_published)
    weights = dummy_weights(config, torch.float32, "cpu", "fp8")
    for name in ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.2.mlp.experts.gate_up_proj"):
        values = weights[name]
        dense = (values.dequantize() if isinstance(values, QuantizedExperts)
                 else values.data.float() * values.scale.repeat_interleave(128, 0)[:values.shape[0]]
                 .repeat_interleave(128, 1)[:, :values.shape[1]])
        std = dense.std().item() * values.shape[-1] ** 0.5  # ~1 for N(0, 1 / fan-in)
        assert torch.isfinite(dense).all() and 0.5 < std < 2.0, (name, std)
    tid2eid = weights["model.layers.0.mlp.gate.tid2eid"]
    assert tid2eid.dtype == torch.long and all(len(set(row)) == len(row) for row in tid2eid.tolist()[:50])


@pytest.mark.parametrize("weight_format", ["dequantize", "fp8"])
def test_v4_flash_config_file_served_with_dummy_weights(weight_format):
    """docs/configs/deepseek-v4-flash.config.json as the checkpoint, shrunk by hf_overrides, its MTP layer drafting:
    finite logits at every step, greedy tokens end to end, ids past the built-in tokenizer's 512 decoded without a
    crash."""
    engine = LLMEngine(EngineConfig(checkpoint=str(FLASH), load_format="dummy", hf_overrides=TINY_FLASH, device="cpu",
                                    weight_format=weight_format, num_speculative_tokens=1, num_tokens=8192,
                                    max_num_batched_tokens=1024))
    assert (engine.deployment.numerics.name, engine.deployment.kv_layout.name) == ("deepseek", "fp8")
    assert engine.tokenizer.get_vocab_size() == 512 and engine.vocab_size == 1024
    logits, forward = [], engine.model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out[0] if isinstance(out, tuple) else out)
        return out

    engine.model.forward = recording
    try:
        results = engine.generate([list(range(2, 300)), [7, 8, 9]], SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.shutdown()
    assert [len(r["output_ids"]) for r in results] == [12, 12]
    logits = [x for x in logits if x.numel()]  # (a prefill chunk that samples nothing has none)
    assert logits and all(torch.isfinite(x).all() and x.std() > 0 for x in logits)
    ids = [t for r in results for t in r["output_ids"]]
    assert len(set(ids)) > 2 and max(ids) >= 512 and all(isinstance(r["text"], str) for r in results)


def test_routers_score_experts_apart():
    config = load_model_config(FLASH, TINY_FLASH)
    weights = dummy_weights(config, torch.float32, "cpu", "dequantize")
    hidden = weights["model.embed_tokens.weight"][:64]
    scores = hidden @ weights["model.layers.3.mlp.gate.weight"].T  # [tokens, experts]
    top = scores.topk(config.num_experts_per_tok + 1, dim=1).values
    assert (top[:, :-1] - top[:, 1:]).min() > 1e-4  # no ties within any token's top k (and the next)


def test_a_directory_with_only_config_json(tmp_path, tiny_checkpoint):
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    engine = LLMEngine(EngineConfig(checkpoint=str(tmp_path), load_format="dummy", device="cpu",
                                    hf_overrides={"num_hidden_layers": 2}))
    try:
        assert engine.model_config.num_hidden_layers == 2
        assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0]["output_ids"]) == 4
    finally:
        engine.shutdown()
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 4  # the file is not changed


def test_a_ranks_part_of_a_column_split_weight_is_scaled_by_the_whole_fan_in():
    """Under tensor parallelism a rank holds some of o_b's and the down projections' columns: their block scales are
    the whole weight's (1 / sqrt of its fan-in), as one rank's, not 2x larger at 2 ranks. (V4-Flash's formats at
    widths whose halves stay on the 128-wide block grid.)"""
    config = load_model_config(FLASH, {**TINY_FLASH_OVERRIDES, "num_hidden_layers": 1, "hidden_size": 256,
                                       "moe_intermediate_size": 256, "o_lora_rank": 128})
    alone = dummy_weights(config, torch.float32, "cpu", "fp8")
    part = dummy_weights(config, torch.float32, "cpu", "fp8", ParallelLayout(2, 1, rank=0))
    for name in ("model.layers.0.self_attn.o_b_proj.weight", "model.layers.0.mlp.shared_experts.down_proj.weight",
                 "model.layers.0.mlp.experts.down_proj"):
        assert part[name].shape[-1] < alone[name].shape[-1], name  # (split by columns)
        assert part[name].scale.unique().tolist() == alone[name].scale.unique().tolist(), name


def test_a_device_too_small_for_the_dummy_weights_is_told_how_many_layers_it_has(monkeypatch):
    """Out of memory while building (a GPU holding fewer layers than asked) is a ConfigError naming the tensor, what
    was built, the layer count and what sizes it: not torch's bare OutOfMemoryError."""
    from backend.errors import ConfigError
    from backend.model import dummy_weights as module

    config = load_model_config(FLASH, TINY_FLASH)
    real, calls = module._dummy_tensor, []

    def failing_at_the_tenth(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 10:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_dummy_tensor", failing_at_the_tenth)
    expected = r"out of memory at (\S+) after .* GiB .*num_hidden_layers, now 4.*plan_memory"
    with pytest.raises(ConfigError, match=expected) as refused:
        dummy_weights(config, torch.bfloat16, "cpu", "fp8")
    assert len(calls) == 10 and f"at {calls[-1]} after" in str(refused.value)
