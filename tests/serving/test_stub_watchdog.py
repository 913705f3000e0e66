"""backend/serving/stub_watchdog.py with real processes: a stand-in "server" (a shell) and "stub" (its child, with a
child of its own, as a worker rank) and the watchdog as the stub's child, as model.py starts it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from backend.serving import stub_watchdog

WATCHDOG = Path(stub_watchdog.__file__)


def _alive(pid: int) -> bool:
    return stub_watchdog.parent_of(pid) is not None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _server_stub_worker(tmp_path: Path) -> tuple[subprocess.Popen, int, int, Path]:
    """A "server" shell whose child "stub" starts a "worker" and the watchdog (on itself and the server), then sleeps
    with SIGTERM ignored, as a stub whose threads wait forever would."""
    shm = tmp_path / "shm-region"
    shm.write_text("")
    pids = tmp_path / "pids"
    stub = (f"trap '' TERM; sleep 1000 & echo $$ $! > {pids}; "
            f"{sys.executable} {WATCHDOG} --stub $$ --server $PPID --poll-s 0.05 --grace-s 0.5 & "
            "while :; do sleep 0.1; done")
    server = subprocess.Popen(["bash", "-c", f"bash -c {shlex.quote(stub)} & wait"], start_new_session=True)
    assert _wait_until(lambda: pids.exists() and len(pids.read_text().split()) == 2)
    stub_pid, worker_pid = map(int, pids.read_text().split())
    return server, stub_pid, worker_pid, shm


def test_a_stub_whose_server_is_gone_is_killed_with_its_workers(tmp_path):
    server, stub, worker, _ = _server_stub_worker(tmp_path)
    time.sleep(0.3)
    assert _alive(stub) and _alive(worker)  # the server is there: nothing happens
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    assert _wait_until(lambda: not _alive(stub) and not _alive(worker), timeout=5)


def test_the_watchdog_leaves_with_the_stub(tmp_path):
    server, stub, worker, _ = _server_stub_worker(tmp_path)
    def watchdogs() -> list[int]:
        return [p for p in stub_watchdog.descendants(stub) if b"stub_watchdog" in _cmdline(p)]

    assert _wait_until(lambda: len(watchdogs()) == 1)
    watchdog = watchdogs()[0]
    os.kill(stub, signal.SIGKILL)
    assert _wait_until(lambda: not _alive(watchdog), timeout=5)
    os.kill(worker, signal.SIGKILL)
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def test_watch_removes_the_shm_region_of_a_stub_it_kills(tmp_path, monkeypatch):
    server, stub, worker, shm = _server_stub_worker(tmp_path)
    monkeypatch.setattr(stub_watchdog, "Path", lambda *parts: tmp_path.joinpath(*parts[1:]) if parts[0] == "/dev/shm"
                        else Path(*parts))
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    assert stub_watchdog.watch(stub, server.pid, shm.name, poll_s=0.05, grace_s=0.2) == "server gone, stub killed"
    assert not shm.exists() and _wait_until(lambda: not _alive(worker))
