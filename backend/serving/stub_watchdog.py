"""A process beside the Python-backend stub that ends the stub when tritonserver is gone.

    python3 backend/serving/stub_watchdog.py --stub PID --server PID [--shm NAME]

Why a process and not a thread of the stub: a call into the Python backend's API (a metric's `set`, a logger line,
`is_cancelled`) waits for tritonserver's answer while holding the GIL, and tritonserver stops answering when it
exits. If it exits with such a call in flight (its exit timeout hit, a crash, SIGKILL), every Python thread of the stub
waits for the GIL forever and no thread of the stub's own can notice: the stub would keep its memory (on a GPU, the
GPU's), its worker ranks and its /dev/shm region for good. This process shares no lock with the stub.

It polls the stub's parent; once that is no longer the server, it gives the stub `--grace-s` to exit on its own, then
kills it and its descendants (tensor / data-parallel worker ranks) and removes the stub's shm region, which the server
would have removed. It exits as soon as the stub does. It ignores SIGINT: a Ctrl-C in the server's terminal reaches the
whole process group, and the watchdog must outlive the server to do its job. Standard library only, so any Python 3
runs it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_for_this_stub() -> subprocess.Popen:
    """Start the watchdog for this process (the stub; its command line names its shm region) and its parent (the
    server). Called first thing in the model's `initialize`, so a load that hangs is covered too."""
    argv = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    shm = ["--shm", argv[2].decode()] if len(argv) > 2 and argv[2] else []  # the stub's arguments: model, shm region
    python = shutil.which("python3") or sys.executable  # the standard library is all it needs
    return subprocess.Popen([python, __file__, "--stub", str(os.getpid()), "--server", str(os.getppid()), *shm],
                            stdin=subprocess.DEVNULL, close_fds=True)


def parent_of(pid: int) -> int | None:
    """The parent pid of a live process; None when it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        child = int(stat.parent.name)
        parent = parent_of(child)
        if parent is not None:
            children.setdefault(parent, []).append(child)
    found, frontier = [], [pid]
    while frontier:
        below = [c for p in frontier for c in children.get(p, [])]
        found += below
        frontier = below
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it but this one (the watchdog is the stub's child)."""
    for target in [pid] + [p for p in descendants(pid) if p != os.getpid()]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def watch(stub: int, server: int, shm: str | None, poll_s: float, grace_s: float) -> str:
    """Block until the stub is gone; return what happened."""
    while True:
        parent = parent_of(stub)
        if parent is None:
            return "stub exited"
        if parent != server:
            break
        time.sleep(poll_s)
    deadline = time.monotonic() + grace_s
    while parent_of(stub) is not None and time.monotonic() < deadline:
        time.sleep(poll_s / 5)
    outcome = "server gone, stub exited"
    if parent_of(stub) is not None:
        kill_tree(stub)
        outcome = "server gone, stub killed"
    if shm:
        Path("/dev/shm", shm).unlink(missing_ok=True)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stub", type=int, required=True, help="the stub's pid")
    parser.add_argument("--server", type=int, required=True, help="tritonserver's pid (the stub's parent)")
    parser.add_argument("--shm", help="the stub's shm region, removed if the stub is killed")
    parser.add_argument("--poll-s", type=float, default=0.25)
    parser.add_argument("--grace-s", type=float, default=2.0, help="how long the stub may take to exit on its own")
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outcome = watch(args.stub, args.server, args.shm, args.poll_s, args.grace_s)
    if outcome != "stub exited":  # the server's log (our stderr) says why a stub went away without it
        print(f"[dsv4 stub watchdog] stub {args.stub}: {outcome}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
