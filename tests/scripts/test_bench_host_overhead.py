"""scripts/bench_host_overhead.py's part 5 compares what it says: the heap frozen as the engine serves against the
same requests with it thawed, every request's gaps between tokens counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_churn_compares_the_frozen_heap_with_the_thawed_one(tiny_checkpoint, tmp_path):
    out = tmp_path / "churn.json"
    subprocess.run([sys.executable, "scripts/bench_host_overhead.py", "--checkpoint", str(tiny_checkpoint),
                    "--skip-host", "--skip-stand-in", "--churn-seconds", "2", "--churn-rows", "4", "--repeats", "1",
                    "--json", str(out)], check=True, cwd=REPO, capture_output=True, timeout=600)
    churn = json.loads(out.read_text())["churn"]
    assert churn["frozen"]["frozen_objects"]["median"] > 10_000
    assert churn["thawed"]["frozen_objects"]["median"] == 0
    for cell in churn.values():
        assert cell["gaps"]["median"] > 50  # (4 requests, 2 s of steps)
        assert 0 < cell["median_ms"]["median"] <= cell["p99_ms"]["median"] <= cell["max_ms"]["median"]
