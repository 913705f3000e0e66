"""The launch budget of a decode step on the GPU code path (Triton kernels, interpreted on CPU).

scripts/count_launches.py is the benchmark that reports the numbers; this pins the budget so a change
that adds launches or a host synchronisation to the decode step fails here rather than on a GPU.
"""

from __future__ import annotations

from pathlib import Path

from count_launches import measure
from tests.conftest import TINY_FLASH_OVERRIDES

# The budget for a decode step on the GPU path (the step achieves 17-23 per layer on the tiny model, 15-23
# with DeepSeek-V4's published formats and numerics).
MAX_LAUNCHES_PER_LAYER = 40
FLASH = Path(__file__).resolve().parents[2] / "docs" / "configs" / "deepseek-v4-flash.config.json"
PUBLISHED = dict(weight_format="fp8", numerics="deepseek", kv_cache_dtype="fp8")


def test_decode_step_stays_within_the_launch_budget_with_no_host_sync(tiny_checkpoint):
    result = measure(tiny_checkpoint, batch=4, steps=2, mode="triton")
    assert result["syncs_per_step"] == 0, result["syncs"]
    worst = max(result["per_layer"].values())
    assert worst <= MAX_LAUNCHES_PER_LAYER, (worst, result["top_ops"])
    # every kind of layer of the tiny model was counted, each issuing real work
    assert set(result["per_layer_kind"]) == {"sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"}
    assert min(result["per_layer"].values()) >= 15


def test_decode_step_in_the_published_formats_stays_within_the_launch_budget():
    """V4-Flash's layer kinds in its published formats (FP8 linears, MXFP4 experts), DeepSeek's numerics and the fp8
    KV cache: each activation quantizer and the indexer's rotation is one launch, not a torch expression of a dozen
    (a CSA layer issued 118 launches a decode step that way)."""
    result = measure(FLASH, batch=8, steps=2, mode="triton", load_format="dummy",
                     hf_overrides=dict(TINY_FLASH_OVERRIDES, num_hidden_layers=4), **PUBLISHED)
    assert result["syncs_per_step"] == 0, result["syncs"]
    assert set(result["per_layer_kind"]) == {"sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"}
    worst = max(result["per_layer"].values())
    assert worst <= MAX_LAUNCHES_PER_LAYER, (worst, result["ops_per_layer_kind"])
    ops = result["ops_per_layer_kind"]["compressed_sparse_attention"]
    # no launch of its own for a quantizer: the indexer's queries are rounded by their rope's launch, the experts
    # quantize their input themselves
    assert "triton:_round_kernel" not in ops
    # kv's norm and rope alone: the attention norms and ropes its queries and un-ropes its output, the FP8 GEMMs that
    # read q_a's norm compute it, and the indexer's queries are roped and rounded by the GEMM that writes them
    assert ops["triton:_norm_rope_kernel"] == 1
    assert "triton:_swiglu_kernel" not in ops  # the shared expert's w2 GEMM computes its SwiGLU as it loads
    assert "triton:_act_quant_kernel" not in ops  # the collapse before the MoE writes x act_quant'ed too
    assert ops["triton:_fp8_gemm_kernel"] >= 5  # the FP8 linears ran in their format


def test_the_counter_sees_torch_ops_triton_launches_and_syncs(tiny_checkpoint):
    import torch

    from count_launches import counting
    from backend.model.config import load_model_config

    class Model:  # the counter attributes launches inside `_layer` to the layer
        def _layer(self, i, x):
            y = x + 1  # one launch
            y.view(-1)  # a view: none
            return int(y.sum())  # one launch (sum) and one sync (.item)

    model = Model()
    with counting(model) as counter:
        model._layer(3, torch.ones(4))
        torch.arange(3).tolist()  # outside any layer: one launch (arange), one sync (tolist)
    assert counter.launches == {3: 2, "step": 2}  # torch.ones is a fill launch too
    assert sum(counter.syncs.values()) == 2
    assert load_model_config(tiny_checkpoint).num_hidden_layers == 4
