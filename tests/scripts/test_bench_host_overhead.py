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


def test_the_overlap_ratio_is_each_repetitions_own(tiny_checkpoint, tmp_path):
    """Part 2 runs overlap off and on in turn within each repetition, and reports each repetition's on / off ratio
    (a side-by-side ratio), not one setting's median over the other's."""
    out = tmp_path / "stand_in.json"
    run = subprocess.run([sys.executable, "scripts/bench_host_overhead.py", "--checkpoint", str(tiny_checkpoint),
                          "--skip-host", "--churn-seconds", "0", "--sleep-rows", "4", "--sleep-context", "64",
                          "--steps", "10", "--repeats", "2", "--json", str(out)],
                         check=True, cwd=REPO, capture_output=True, text=True, timeout=600)
    cells = json.loads(out.read_text())["device_stand_in"]
    off, on = (cells[f"k=0 overlap={flag}"]["steps_per_s"]["runs"] for flag in (False, True))
    ratio = cells["k=0 on/off"]["steps_per_s"]
    assert sorted(ratio["runs"]) == sorted(b / a for a, b in zip(off, on)) and len(ratio["runs"]) == 2
    assert "k=0 overlap on / off, each repetition's:" in run.stdout
