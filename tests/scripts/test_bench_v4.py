"""scripts/bench_v4.py at tiny shapes on CPU: V4-Flash's config shrunk by hf_overrides, dummy weights in the published
formats, decode steps and a prefill timed, each beside a positive roofline, the JSON and CSV written."""

from __future__ import annotations

import csv
import json
import re

import bench_v4
import pytest

from backend.config import ConfigError

from tests.conftest import TINY_FLASH_OVERRIDES


def test_tiny_v4_shapes_run_writes_steps_beside_their_rooflines(tmp_path, capsys):
    out = tmp_path / "v4_shapes.json"
    assert bench_v4.main(["--device", "cpu", "--hf-overrides", json.dumps(TINY_FLASH_OVERRIDES), "--layers", "4",
                          "--batches", "1", "2", "--context", "256", "--repeat", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["batch"], r["layers"]) for r in rows] == [
        ("decode", 1, 4), ("decode", 1, 43), ("decode", 2, 4), ("decode", 2, 43), ("prefill", 1, 4), ("prefill", 1, 43)]
    for r in rows:
        assert r["context"] == 256 and r["step_ms"] > 0 and r["roofline_ms"] > 0 and r["per_layer_ms"] > 0
        assert r["extrapolated"] == (r["layers"] == 43) and r["variant"] == ""
    one, two = rows[0], rows[2]
    assert two["weight_gb"] > one["weight_gb"]  # two requests reach more experts than one
    measured, extrapolated = rows[0], rows[1]
    assert extrapolated["step_ms"] == measured["outside_ms"] + 43 * measured["per_layer_ms"]
    assert extrapolated["roofline_ms"] > 5 * measured["roofline_ms"]  # the 43 layers' bytes, not 4's
    assert rows[-2]["tokens_per_s"] == 256 / rows[-2]["step_ms"] * 1e3
    with open(out.with_suffix(".csv")) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert re.search(r"decode +2 +256 +43\* \|", capsys.readouterr().out)  # the table, extrapolated rows marked


def test_the_cuda_variants_are_refused_off_a_gpu():
    """--variants time steps with programmatic dependent launch or a second stream beside those without (on a GPU:
    gpu_check.sh's v4_shapes part); a CPU has neither, which the run says before building anything, nor leaving an empty
    results folder in the checkout."""
    results_existed = bench_v4.default_out().parent.exists()
    tiny = ["--device", "cpu", "--hf-overrides", json.dumps(TINY_FLASH_OVERRIDES), "--layers", "4", "--batches", "1",
            "--context", "256", "--repeat", "1"]
    with pytest.raises(ConfigError, match="programmatic_dependent_launch.*no CUDA device"):
        bench_v4.main(tiny + ["--variants", "pdl"])
    with pytest.raises(SystemExit, match="--device cuda"):
        bench_v4.main(tiny + ["--variants", "side_stream"])
    assert bench_v4.default_out().parent.exists() == results_existed
