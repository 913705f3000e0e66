"""scripts/check_engine_device.py, the GPU check's engine comparison, runs here on CPU (`--device cpu`: the
padded static step eagerly), so the one prepared GPU run does not fail on the script itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engine_check_passes_on_cpu(tmp_path, tiny_checkpoint):
    out = tmp_path / "engine.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_engine_device.py"), "--device", "cpu",
                             "--max-tokens", "6", "--checkpoint", str(tiny_checkpoint),
                             "--num-speculative-tokens", "1", "2", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    required = [r for r in report["runs"] if r["required"]]
    assert [(r["dtype"], r["cuda_graphs"], r["num_speculative_tokens"]) for r in required] == [
        ("float32", False, 0), ("float32", True, 0), ("float32", False, 1), ("float32", True, 1), ("float32", False, 2),
        ("float32", True, 2)]
    assert all(r["equal_to_cpu_fp32"] for r in required) and report["bf16_graphs_equal"]
    assert all(r["cached_tokens"] > 0 for r in report["runs"])  # the second wave came from the prefix cache
    assert [(r["num_speculative_tokens"], r["repeated"], r["logprobs_valid"]) for r in report["sampled"]] == [
        (0, True, True), (1, True, True), (2, True, True)]  # seeded sampling repeats, with and without drafts
