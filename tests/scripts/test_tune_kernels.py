"""scripts/tune_kernels.py on CPU (--device cpu --tiny, the kernels under the interpreter): the file it writes is read
back by kernels/tuning.py and changes the launch plans of the kernels it tuned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import tuning

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.bench_kernels import (DRY, decode_positions, fp4_indexer_inputs, fp8_attention_inputs,  # noqa: E402
                                   fp8_layout_shapes, fp8_linear_weight)


@pytest.fixture(scope="module")
def tuned_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tune") / "cpu.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "tune_kernels.py"), "--device", "cpu", "--tiny",
                             "--repeat", "1", "--out", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _launch_options(plan) -> dict:
    """The tiles and launch options of a plan's first launch."""
    kwargs = plan[1][0][3]
    return {k: v for k, v in kwargs.items() if k.startswith("BLOCK") or k in ("num_warps", "num_stages")}


def _plans():
    """The plans of the tiny sweeps' kernels at one decode token (the MoE's: its configuration at one token's pairs)."""
    from kernels.attention import plan_sparse_paged_attention
    from kernels.fp32_linear import plan_fp32_linear
    from kernels.fp8_gemm import Fp8Weight, plan_fp8_gemm
    from kernels.grouped_linear import plan_grouped_linear
    from kernels.indexer import plan_indexer_scores
    from kernels.moe import moe_config

    s, gen = fp8_layout_shapes(DRY), torch.Generator().manual_seed(0)
    args, kwargs, _ = fp8_attention_inputs(torch, s, torch.device("cpu"), decode_positions(s, 1), "csa")
    indexer_args, _ = fp4_indexer_inputs(torch, s, torch.device("cpu"), decode_positions(s, 1))
    n, k = DRY.fp8_linears["irregular"]
    o_in = DRY.num_heads * DRY.head_dim // DRY.o_groups
    return {"attention": _launch_options(plan_sparse_paged_attention(*args, **kwargs)),
            "indexer": _launch_options(plan_indexer_scores(*indexer_args)),
            "fp8_gemm": _launch_options(plan_fp8_gemm(torch.randn(1, k).to(torch.bfloat16),
                                                      *fp8_linear_weight(torch, "cpu", n, k, gen))),
            "moe": moe_config(DRY.top_k, DRY.num_experts, DRY.hidden, DRY.moe_inter),
            "grouped_fp8": _launch_options(plan_grouped_linear(
                torch.randn(1, DRY.o_groups, o_in).to(torch.bfloat16),
                Fp8Weight(*fp8_linear_weight(torch, "cpu", DRY.o_groups * DRY.o_lora_rank, o_in, gen)))),
            "fp32_linear": _launch_options(plan_fp32_linear(torch.randn(1, DRY.hidden).to(torch.bfloat16),
                                                            torch.randn(DRY.vocab, DRY.hidden).to(torch.bfloat16)))}


def test_the_written_configurations_change_the_plans(tuned_file):
    written = json.loads(tuned_file.read_text())
    assert written["device"] == "cpu" and set(written["kernels"]) == {"attention", "indexer", "fp8_gemm", "moe",
                                                                       "grouped_fp8", "fp32_linear"}
    default = _plans()
    tuning.load(tuned_file)
    try:
        tuned = _plans()
    finally:
        tuning.load(None)
    table = tuning.read_table(tuned_file)
    for kernel, plan in tuned.items():
        (change_at_one_token,) = [by_count[DRY.top_k if kernel == "moe" else 1] for by_count in table[kernel].values()]
        assert plan != default[kernel] and change_at_one_token, kernel
        launched = {k: v for k, v in change_at_one_token.items() if k in plan}  # (the launch options of it)
        assert tuning.overlay(plan, launched) == plan, (kernel, plan, change_at_one_token)


def test_every_fp8_gemm_plan_is_valid_whatever_count_a_change_was_tuned_at():
    """Each candidate of the V4-Flash fp8 GEMM sweep, written as tuned at every count the sweep times (the change it
    makes of that count's default), for every V4-Flash linear: at every token count from 1 to 300 and the prefill's,
    the plan keeps what its count decides (the orientation, x act_quant'ed ahead) and splits K over no more tiles than
    the split's counters take (a change tuned where K was split, laid over a count with more tiles, once asserted)."""
    from kernels.fp8_gemm import QUANTIZE_AHEAD_MIN_TOKENS, SPLIT_COUNTERS, SWAP_AB_MAX_TOKENS, fp8_gemm_config
    from scripts.bench_kernels import FULL
    from scripts.tune_kernels import v4_flash_sweeps

    (sweep,) = [sw for sw in v4_flash_sweeps() if sw.kernel == "fp8_gemm"]
    num_sms, counts = 132, [*FULL.decode_batches, FULL.prefill_tokens]
    for n, k in FULL.fp8_linears.values():
        with tuning.using({}), tuning.recording() as asked:
            for count in counts:
                fp8_gemm_config(count, n, k, num_sms)
        key = asked[0][1]
        defaults = {count: default for _, _, count, default in asked}
        for patch in sweep.patches:
            changes = {count: tuning.difference(tuning.overlay(d, patch(d) if callable(patch) else patch), d)
                       for count, d in defaults.items()}
            with tuning.using({"fp8_gemm": {key: changes}}):
                for t in [*range(1, 301), FULL.prefill_tokens]:
                    for head_dim in (None, 128) if n % 128 == 0 else (None,):
                        cfg = fp8_gemm_config(t, n, k, num_sms, head_dim)
                        tiles = -(-t // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
                        assert cfg["SPLIT_K"] == 1 or tiles <= SPLIT_COUNTERS, (n, k, t, patch, cfg)
                        assert cfg["SWAP_AB"] == (t <= SWAP_AB_MAX_TOKENS), (n, k, t, cfg)
                        assert cfg["PREQUANTIZED"] == (t >= QUANTIZE_AHEAD_MIN_TOKENS), (n, k, t, cfg)


def test_a_run_of_some_sweeps_keeps_what_the_file_held(tmp_path):
    """A run cut by its time limit (or limited to some sweeps) replaces its sweeps' entries and keeps the rest of the
    table it found: a later, shorter run does not throw an earlier full tuning away."""
    out = tmp_path / "cpu.json"
    tuning.write_table(out, {"earlier": {"shape": {1: {"BLOCK_N": 8}}}}, device="cpu")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "tune_kernels.py"), "--device", "cpu", "--tiny",
                             "--repeat", "1", "--sweeps", "fp32 linear", "--out", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    table = tuning.read_table(out)
    assert table["earlier"] == {"shape": {1: {"BLOCK_N": 8}}} and "fp32_linear" in table, sorted(table)


def test_a_count_the_budget_cuts_short_is_left_as_an_earlier_run_tuned_it(monkeypatch):
    """Past the deadline no candidate starts, and a count whose candidates were not all timed is not written: an
    earlier run's full tuning there stands (a default timed alone would have replaced it by {})."""
    import types

    from scripts import tune_kernels

    out = torch.ones(2)

    def run():
        tuning.tuned("fp32_linear", dict(n=1, k=1, tokens=1), dict(BLOCK_N=8))
        return out

    sweep = tune_kernels.Sweep("fake", "fp32_linear", lambda torch, device: iter([(run, lambda: out)]),
                               [dict(BLOCK_N=16), dict(BLOCK_N=32)], run_ms=0.1)
    clock = [0.0]
    monkeypatch.setattr(tune_kernels, "time", types.SimpleNamespace(time=lambda: clock[0]))

    def timer(fn):  # (each candidate timed takes 10 s of the fake clock; all equally fast)
        clock[0] += 10.0
        return 1.0

    assert tune_kernels.run_sweep(torch, torch.device("cpu"), timer, sweep, tiny=False, deadline=15.0) == {}
    clock[0] = 0.0
    assert tune_kernels.run_sweep(torch, torch.device("cpu"), timer, sweep, tiny=False, deadline=100.0) == \
        {"k=1,n=1": {1: {}}}
