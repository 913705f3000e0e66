"""backend/host_memory.py: with the engine's malloc settings, a CPU step's freed temporaries are reused, not
faulted in again (page faults counted by the kernel); a serving engine's start-up objects are left out of the garbage
collector's walks until it shuts down. Each case in a fresh process (both are the process's own state)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROUNDS = 4
PAGES_PER_ROUND = 64 * (1 << 20) // 4096

SCRIPT = """
import resource, sys, torch
keep = sys.argv[1] == "keep"
if keep:
    from backend.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
for _ in range({rounds}):  # a step's temporaries: 64 blocks of 1 MiB, written, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(256 * 1024) for _ in range(64)]
    del blocks
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(script: str, *args: str) -> str:
    return subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout


def _faults_per_round(mode: str) -> list[int]:
    return [int(line) for line in _run(SCRIPT.format(rounds=ROUNDS), mode).split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and the kernel's fault count")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = _faults_per_round("default"), _faults_per_round("keep")
    # glibc's default unmaps the blocks when freed: the next round faults every page in again
    assert default[1] > PAGES_PER_ROUND // 2, default
    # with the settings, the first round faults the pages in and later rounds reuse them
    assert kept[0] > PAGES_PER_ROUND // 2, kept
    assert all(faults < PAGES_PER_ROUND // 20 for faults in kept[2:]), kept


FREEZE_SCRIPT = """
import gc, sys
from backend.config import EngineConfig
from backend.engine import LLMEngine
engine = LLMEngine(EngineConfig(checkpoint=sys.argv[1], device="cpu", max_running_requests=2))
walked = lambda obj: any(o is obj for o in gc.get_objects())  # (the permanent generation is not listed)
print(gc.get_freeze_count(), walked(engine.scheduler))
engine.start()
print(gc.get_freeze_count(), walked(engine.scheduler))
engine.shutdown()
print(gc.get_freeze_count(), walked(engine.scheduler))
"""


def test_a_serving_engine_freezes_its_start_up_objects_until_it_shuts_down(tiny_checkpoint):
    built, started, stopped = [line.split() for line in _run(FREEZE_SCRIPT, str(tiny_checkpoint)).splitlines()]
    assert built == ["0", "True"]  # an engine used offline (generate()) changes nothing
    assert int(started[0]) > 10_000 and started[1] == "False"  # serving: out of the collector's walks
    assert stopped == ["0", "True"]  # shut down: collectable again
