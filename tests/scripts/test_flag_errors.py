"""The command-line scripts a user meets: an ordinary mistake (a missing file, a value out of range, a flag without
its value, a pattern that matches nothing) is one line naming the flag and a non-zero exit, not a traceback nor a
pass."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLASH = "docs/configs/deepseek-v4-flash.config.json"


@pytest.mark.parametrize("command, message", [
    (["scripts/plan_memory.py", "--config", "/nonexistent.json"], "error: --config: [Errno 2] No such file"),
    (["scripts/plan_memory.py", "--config", FLASH, "--tensor-parallel-size", "3"],
     "error: parameter 'tensor_parallel_size': 3 ranks cannot split the model's num_attention_heads (64)"),
    (["scripts/plan_memory.py", "--config", FLASH, "--page-size", "0"], "argument --page-size: must be at least 1"),
    (["scripts/plan_memory.py", "--config", FLASH, "--num-speculative-tokens", "-1"],
     "argument --num-speculative-tokens: must be at least 0"),
    (["scripts/estimate_decode_step.py", "--config", FLASH, "--ranks", "0"], "argument --ranks: must be at least 1"),
    (["scripts/estimate_decode_step.py", "--config", FLASH, "--ranks", "3"], "(--ranks 3): parameter"),
    (["scripts/estimate_decode_step.py", "--config", FLASH, "--drafts", "2", "--acceptance", "0.3,0.5"],
     "error: --acceptance: per-position acceptance rates cannot increase"),
    (["scripts/estimate_decode_step.py", "--config", FLASH, "--drafts", "2", "--acceptance", "0.7", "x"],
     "error: --acceptance: acceptance rates are numbers, got '0.7 x'"),
    (["scripts/bench_speculative.py", "--runs", "0"], "argument --runs: must be at least 1"),
    (["scripts/check_kernels_compile.py", "--sass", "no such kernel", "--jobs", "1"], "matches no case"),
    (["scripts/check_kernels_compile.py", "--sass", "("], "--sass '(': missing )"),
])
def test_a_python_scripts_bad_flag_is_an_argparse_error(command, message):
    run = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.parametrize("command", [["scripts/serve.sh", "--set"], ["scripts/serve.sh", "--http-port"],
                                     ["scripts/perf_analyzer.sh", "--out"]])
def test_a_shell_scripts_flag_without_its_value_says_so(command):
    run = subprocess.run(["bash", *command], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{command[-1]} needs a value" in run.stderr, run.stderr


def test_acceptance_rates_are_taken_with_commas_or_spaces():
    """`--acceptance 0.77 0.38` and `--acceptance 0.77,0.38` (the form bench_speculative.py's docs give) are one."""
    tables = [subprocess.run([sys.executable, "scripts/estimate_decode_step.py", "--config", FLASH, "--batch", "1",
                              "--contexts", "8192", "--drafts", "2", "--acceptance", *rates], cwd=REPO,
                             capture_output=True, text=True, timeout=120, check=True).stdout
              for rates in (["0.77", "0.38"], ["0.77,0.38"])]
    assert tables[0] == tables[1] and "speed-up at acceptance 0.77 0.38" in tables[0], tables


def test_the_busiest_data_parallel_rank_is_counted():
    """12 requests over 8 ranks: the busiest rank attends to 2 (it showed 1)."""
    run = subprocess.run([sys.executable, "scripts/estimate_decode_step.py", "--config", FLASH, "--ranks", "8",
                          "--batch", "12", "--contexts", "8192"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    (dp,) = [line.split() for line in run.stdout.splitlines() if line.split()[1:2] == ["dp"]]
    assert dp[2] == "2", run.stdout
