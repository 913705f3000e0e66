"""scripts/train_mtp_draft.py: a few steps of training change the MTP layer and nothing else, and the engine then
serves the written checkpoint with speculation and reports the acceptance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]


def test_training_rewrites_only_the_draft_layer(tiny_checkpoint, tmp_path):
    out, report = tmp_path / "trained", tmp_path / "train.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "train_mtp_draft.py"), "--checkpoint",
                             str(tiny_checkpoint), "--out", str(out), "--sequences", "4", "--steps", "3",
                             "--prompt-tokens", "8", "--new-tokens", "24", "--json", str(report)],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = load_file(tiny_checkpoint / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(before) == set(after)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith("model.mtp.0.") for name in changed)
    assert "model.mtp.0.e_proj.weight" in changed and "model.mtp.0.self_attn.q_a_proj.weight" in changed
    measured = json.loads(report.read_text())
    assert [row["k"] for row in measured["acceptance"]] == [1, 2, 3]
    assert all(row["mean_accepted_length"] >= 1.0 for row in measured["acceptance"])
