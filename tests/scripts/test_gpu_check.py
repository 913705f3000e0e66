"""scripts/gpu_check.sh runs only on a lent GPU, and a loan is rare and short: a flag that a script no longer takes
would cost that loan a part. Each part's command line is parsed here by its own script's parser, and the parts, their
time limits and the summary are held to the same names."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = (REPO / "scripts" / "gpu_check.sh").read_text()


def part_commands() -> dict[str, str]:
    """{part: its command line} of every `run NAME command...` (continuation lines joined)."""
    parts = {}
    for line in GPU_CHECK.replace("\\\n", " ").splitlines():
        match = re.match(r"\s*run (\w+) (.*)", line)
        if match:
            assert match.group(1) not in parts, f"part {match.group(1)} run twice"
            parts[match.group(1)] = match.group(2)
    return parts


def script_and_args(command: str, results: Path) -> tuple[Path, list[str]]:
    """The Python script a part runs and its arguments, with gpu_check.sh's variables as a run would expand them."""
    for variable, value in {'"${serving_path[@]}"': "", '"${bundle[@]}"': "", '"${xdist[@]}"': "",
                            "${TUNE_BUDGET_S:-150}": "150", "$MTP_CHECKPOINT": "checkpoints/dsv4-tiny",
                            "$RESULTS": str(results), '"$PY"': "python"}.items():
        command = command.replace(variable, value)
    assert "$" not in command, f"a variable this test does not expand: {command}"
    words = shlex.split(command)
    script = next(i for i, word in enumerate(words) if word.endswith(".py"))
    return REPO / words[script], words[script + 1:]


class Parsed(Exception):
    """Raised with the namespace instead of returning it: the script stops right after parsing its command line."""


def parse_with_its_parser(monkeypatch, script: Path, args: list[str]) -> argparse.Namespace:
    spec = importlib.util.spec_from_file_location(f"gpu_check_part_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    with pytest.raises(Parsed) as parsed:
        module.main()
    return parsed.value.args[0]


PYTHON_PARTS = {name: command for name, command in part_commands().items() if name != "kernel_tests"}


@pytest.mark.parametrize("name", sorted(PYTHON_PARTS))
def test_each_part_command_line_is_taken_by_its_script(name, tmp_path, monkeypatch):
    script, args = script_and_args(PYTHON_PARTS[name], tmp_path)
    assert script.is_file(), f"{name}: {script} missing"
    namespace = parse_with_its_parser(monkeypatch, script, args)
    for value in vars(namespace).values():  # the checkpoints it names are there (set-up builds dsv4-tiny)
        if isinstance(value, (str, Path)) and str(value).startswith(("checkpoints/", "docs/configs/")):
            assert (REPO / value).exists(), f"{name}: {value} missing"


def test_every_part_has_a_limit_and_a_line_in_the_summary():
    parts = set(part_commands())
    limits = set(re.findall(r"\[(\w+)\]=\d+", GPU_CHECK))
    summary = re.search(r"for name in ([\w \\\n]+); do", GPU_CHECK).group(1).replace("\\", " ").split()
    assert parts == limits == set(summary), (parts ^ limits, parts ^ set(summary))
    assert len(summary) == len(set(summary))
    assert summary == list(part_commands()), "the summary lists the parts in the order they run"


def test_the_kernel_tests_part_deselects_a_file_that_exists():
    command = part_commands()["kernel_tests"]
    assert "tests/kernels" in command
    for path in re.findall(r"--deselect (\S+)", command):
        assert (REPO / path).is_file(), path


def test_a_deadline_cuts_the_parts_that_keep_what_they_wrote_and_leaves_the_others(tmp_path):
    """GPU_CHECK_DEADLINE_S on this CPU (each part fails fast without a GPU; what matters is what is started): tune,
    which writes after every sweep, starts with the 90 s left although its limit is 1000; engine and v4_shapes
    (whose floor is 120 s) do not start, and the summary names them for the next run."""
    env = {**os.environ, "RESULTS": str(tmp_path), "GPU_CHECK_PARTS": "engine tune v4_shapes",
           "GPU_CHECK_DEADLINE_S": "90", "GPU_CHECK_LIMITS": "engine=1000 tune=1000 v4_shapes=1000"}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    cut = re.search(r"=== tune \(limit (\d+) s \(cut to what is left before GPU_CHECK_DEADLINE_S\)\)", run.stdout)
    assert cut and 0 < int(cut[1]) <= 90, run.stdout  # (90 s less the device part's seconds: more on a loaded machine)
    assert "=== engine" not in run.stdout and "=== v4_shapes" not in run.stdout
    assert re.search(r"engine +not started", run.stdout) and re.search(r"v4_shapes +not started", run.stdout)
    assert 'GPU_CHECK_PARTS="engine v4_shapes"' in run.stdout


def test_a_misspelt_part_is_refused_before_anything_runs(tmp_path):
    """GPU_CHECK_PARTS with a name no part has ran none of the parts (each 'skipped') and passed."""
    env = {**os.environ, "RESULTS": str(tmp_path), "GPU_CHECK_PARTS": "engine speculative-v4"}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "GPU_CHECK_PARTS names no part 'speculative-v4'" in run.stderr
    assert "=== engine" not in run.stdout
