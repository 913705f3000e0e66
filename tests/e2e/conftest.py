"""Fixtures that start a REAL tritonserver for the end-to-end tests.

- `fake_server`: the adapter (model.py) over tests/e2e/fake_engine.py — fast, deterministic.
- `server`: the adapter over the real engine and the built-in checkpoint (checkpoints/dsv4-tiny).

Each server has free ports, its own shm-region prefix, `--exit-timeout-secs=10` (as serve.sh), and is stopped
even when a test fails; its /dev/shm files must be gone afterwards. A failing test's report shows
the tail of the server log.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .triton_helpers import REPO_ROOT, TritonServer

CHECKPOINT = REPO_ROOT / "checkpoints" / "dsv4-tiny"
_SERVERS: list[TritonServer] = []
_STOPPED_IN_THIS_TEST: list[TritonServer] = []  # a test's own server is stopped before its report is made


def pytest_runtest_setup(item):
    _STOPPED_IN_THIS_TEST.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for server in _SERVERS + _STOPPED_IN_THIS_TEST:
            report.sections.append((f"tritonserver log tail ({server.log_path})", server.log_tail()))


def _make_repository(out: Path, *sets: str) -> Path:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "make_model_repository.py"), "--out", str(out)]
    for item in sets:
        cmd += ["--set", item]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def _serve(repository: Path, log_dir: Path, *extra_args: str):
    server = TritonServer(repository, log_dir / "tritonserver.log", extra_args=extra_args)
    server.start()
    _SERVERS.append(server)
    try:
        yield server
    finally:
        _SERVERS.remove(server)
        _STOPPED_IN_THIS_TEST.append(server)
        server.stop()
        assert not server.unclean_stop(), f"unclean stop: {server.unclean_stop()}\n{server.log_tail()}"


@pytest.fixture(scope="module")
def fake_repo_root(tmp_path_factory) -> Path:
    """A repo root whose backend/ is the real adapter-side modules plus the fake engine."""
    root = tmp_path_factory.mktemp("fake_root")
    (root / "backend").mkdir()
    for name in ("config.py", "request.py", "serving"):
        os.symlink(REPO_ROOT / "backend" / name, root / "backend" / name)
    shutil.copy(Path(__file__).with_name("fake_engine.py"), root / "backend" / "engine.py")
    return root


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory, fake_repo_root):
    repository = _make_repository(tmp_path_factory.mktemp("fake_repo"), "max_tokens_limit=1000")
    config = repository / "dsv4" / "config.pbtxt"
    config.write_text(config.read_text().replace(f'"{REPO_ROOT}"', f'"{fake_repo_root}"'))
    yield from _serve(repository, tmp_path_factory.mktemp("fake_log"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (CHECKPOINT / "config.json").is_file():
        pytest.fail(f"{CHECKPOINT} missing: run `bash scripts/setup.sh` (scripts/test.sh does)")
    repository = _make_repository(tmp_path_factory.mktemp("repo"), f"checkpoint={CHECKPOINT}", "device=cpu")
    yield from _serve(repository, tmp_path_factory.mktemp("log"))
