"""The modes a deployment runs in (kernels/modes.py): resolved once, where the deployment is planned, into one
`Numerics` and one `KVLayout`, the same objects in the pools, the kernel dispatch and the model; the code that runs a
forward or keeps the pools asks no tensor's dtype which mode it runs in."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from backend.config import EngineConfig
from backend.deployment import load_model, plan_deployment
from backend.model.comm import Communicator
from kernels.modes import KVLayout, Numerics

REPO = Path(__file__).resolve().parents[2]


def test_transformers_numerics_round_nothing_and_deepseeks_round_everything_it_does():
    transformers = Numerics.of("transformers", quantized_checkpoint=True)
    assert transformers == Numerics() and not any(getattr(transformers, f.name) for f in fields(Numerics)
                                                  if f.name != "name")
    for quantized in (False, True):
        deepseek = Numerics.of("deepseek", quantized_checkpoint=quantized)
        assert all(getattr(deepseek, f.name) for f in fields(Numerics) if f.name not in ("name", "act_quant"))
        assert deepseek.act_quant == quantized  # DeepSeek's FP8/FP4 linears only: a bf16 checkpoint has none
    assert Numerics.of("deepseek", False).compressor_dtype(torch.bfloat16) == torch.float32
    assert transformers.compressor_dtype(torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="numerics"):
        Numerics.of("exact", False)


def test_the_layouts_give_their_widths_in_elements_and_bytes():
    fp8 = KVLayout.deepseek_fp8(head_dim=512, rope_dim=64, index_head_dim=128)  # V4's widths
    assert (fp8.name, fp8.dtype, fp8.entry_width, fp8.entry_bytes, fp8.index_key_bytes) == \
        ("fp8", torch.uint8, 584, 584, 68)
    values = KVLayout.values(torch.bfloat16, head_dim=512, rope_dim=64, index_head_dim=128)
    assert (values.name, values.entry_width, values.entry_bytes, values.index_key_width, values.index_key_bytes) == \
        ("bfloat16", 512, 1024, 128, 256)
    with pytest.raises(ValueError, match="head_dim - rope_dim"):
        KVLayout.deepseek_fp8(head_dim=64, rope_dim=16, index_head_dim=64)  # 48 nope values: not groups of 64
    with pytest.raises(ValueError, match="uint8"):
        KVLayout(True, torch.bfloat16, 512, 64, 128)


@pytest.mark.parametrize("settings", [dict(), dict(numerics="deepseek"),
                                      dict(numerics="deepseek", dtype="bfloat16", kv_cache_dtype="fp8")])
def test_each_mode_is_one_object_shared_by_the_pools_the_dispatch_and_the_model(deepseek_shaped_checkpoint,
                                                                                settings):
    config = EngineConfig(checkpoint=str(deepseek_shaped_checkpoint), device="cpu", **settings)
    dtype = config.resolved_dtype()
    deployment = plan_deployment(config, "cpu", dtype)
    model = load_model(config, deployment, "cpu", dtype, deployment.layout, Communicator())
    assert deployment.numerics.name == settings.get("numerics", "transformers")
    assert deployment.kv_layout.fp8 == (settings.get("kv_cache_dtype") == "fp8")
    assert model.numerics is model.kernels.numerics is deployment.numerics
    kv = deployment.kv
    assert kv.kv_layout is deployment.kv_layout
    assert all(kv.layer(i).kv_layout is deployment.kv_layout for i in range(model.config.num_hidden_layers))
    assert kv.window_pool.kv.dtype == deployment.kv_layout.dtype
    assert kv.state_pool.kv["csa"].dtype == deployment.numerics.compressor_dtype(dtype)


# What running a forward and keeping the pools may not ask: a tensor's dtype (the fp8 layout's pools are uint8), or
# the numerics' name (its fields say what each rounding is).
MODE_SNIFFS = re.compile(r"\.dtype\s*(==|!=|\bin\b)|torch\.uint8|numerics\s*==|deepseek_numerics")
MODE_READERS = ["backend/model/deepseek_v4.py", "backend/model/projections.py", "backend/model/forward_batch.py",
                "kernels/dispatch.py",
                *sorted(str(path.relative_to(REPO)) for path in (REPO / "backend/memory").glob("*.py"))]


@pytest.mark.parametrize("path", MODE_READERS)
def test_the_forward_and_the_pools_ask_no_tensor_which_mode_they_run_in(path):
    sniffs = [f"{path}:{n}: {line.strip()}" for n, line in enumerate((REPO / path).read_text().splitlines(), 1)
              if MODE_SNIFFS.search(line)]
    assert not sniffs, "\n".join(sniffs)
