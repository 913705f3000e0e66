"""The kernels compile for sm_90 without spills or too much shared memory (scripts/check_kernels_compile.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO = Path(__file__).resolve().parents[2]
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton without its bundled CUDA tools")
def test_quick_subset_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest.py sets it for this folder
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "check_kernels_compile.py"), "--quick"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 with problems" in result.stdout
