"""scripts/bench_v4_serving.py at tiny shapes on CPU: the V4-Flash config file served with dummy weights by a real
tritonserver (serve.sh), perf_analyzer's streaming load, time to first token and inter-token latency read from the
server's histograms."""

from __future__ import annotations

import json

import bench_v4_serving  # scripts/ is on sys.path (tests/conftest.py)

from tests.conftest import TINY_FLASH_OVERRIDES


def test_tiny_v4_served_under_load_reports_ttft_and_itl(tmp_path):
    out = tmp_path / "v4_serving"
    assert bench_v4_serving.main(["--device", "cpu", "--layers", "2", "--hf-overrides", json.dumps(TINY_FLASH_OVERRIDES),
                                  "--concurrency", "1", "--input-tokens", "16", "--output-tokens", "6",
                                  "--measurement-interval-ms", "1500", "--ready-timeout-s", "180",
                                  "--out", str(out)]) == 0
    [row] = json.loads((out / "v4_serving.json").read_text())
    assert (row["concurrency"], row["layers"], row["output_tokens"]) == (1, 2, 6)
    assert row["requests"] > 0 and row["requests_per_s"] > 0
    for key in ("ttft_mean_ms", "ttft_p50_ms", "itl_mean_ms", "itl_p50_ms", "itl_p90_ms"):
        assert row[key] > 0, key
    assert (out / "c1" / "summary.csv").is_file() and (out / "server.log").is_file()
