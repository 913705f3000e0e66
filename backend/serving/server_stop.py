"""Noticing that tritonserver is stopping (or unloading this model), and ending the requests still running in time.

tritonserver never tells a model that it stops. On SIGINT or SIGTERM it refuses new requests, starts unloading every
model and gives them `--exit-timeout-secs` to go; a decoupled model's requests do not count as in flight, but the model
is only unloaded once each of them has sent its FINAL response. Streams still decoding when the stop came held it past
the timeout, and tritonserver 2.51 then aborted, often crashing on its way out (Signal 11, with 16 streams of 2,000
tokens on this CPU).

What the model can see is its own readiness: the Python backend's `is_model_ready` raises "Server not ready" from the
moment the server stops (0.3-0.5 s after the signal, measured), and fails or says false while this model unloads (an
explicit unload, a new version). `ServerStopWatch` asks it every `check_s` while requests are running; those running
when the stop is seen get `grace_s` to finish, and those still running after it end with an UNAVAILABLE error, in time
for the model to unload and tritonserver to exit cleanly. By default the grace is what the server's exit timeout leaves
after the time the model needs to go (STOP_MARGIN_S).

Once the stop is seen, readiness is never asked again: the call holds the stub's GIL until tritonserver answers, and
asked every 0.5 s during the stop it went unanswered within seconds in 10 runs of 14 (the whole stub frozen; one more
crashed tritonserver's finalize of the model); asked once, no stub froze in 20 stops with requests running
(docs/serving.md#stopping-the-server). Nor is it asked while no request runs: there is nothing to end then.
"""

from __future__ import annotations

import os
from pathlib import Path

# tritonserver's own default for --exit-timeout-secs.
DEFAULT_EXIT_TIMEOUT_S = 30.0
# What the stop needs after the last request has ended, out of the exit timeout: noticing the stop (check_s),
# tritonserver's one-second polls before and after the unload, finalize() (adapter.SHUTDOWN_TIMEOUT_S, 2.5 s), and a
# second for the stub's own exit and a loaded machine (3.2-3.4 s in all, measured on the 2-core CPU).
STOP_MARGIN_S = 6.0
# A failure to ask for readiness is asked again after check_s doubled per failure in a row, up to this: asks that far
# apart cannot freeze the stub for long (each could be one made during a stop), and a stop is still seen in time.
MAX_CHECK_INTERVAL_S = 2.0


def exit_timeout_s(server_pid: int) -> float:
    """The --exit-timeout-secs on the command line of process `server_pid` (tritonserver), its default when not given
    or when the process cannot be read."""
    try:
        argv = [arg.decode(errors="replace") for arg in Path(f"/proc/{server_pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return DEFAULT_EXIT_TIMEOUT_S
    value = None
    for i, arg in enumerate(argv):  # (the last one given wins, as with any option)
        name, equals, given = arg.partition("=")
        # (getopt_long, as tritonserver parses its options, takes any unambiguous prefix: --exit-t is the shortest)
        if len(name) >= len("--exit-t") and "--exit-timeout-secs".startswith(name):
            value = given if equals else argv[i + 1] if i + 1 < len(argv) else None
    try:
        return float(value) if value is not None else DEFAULT_EXIT_TIMEOUT_S
    except ValueError:
        return DEFAULT_EXIT_TIMEOUT_S


def default_grace_s(server_pid: int | None = None) -> float:
    """How long requests may go on once the stop is seen: the exit timeout of tritonserver (this stub's parent) less
    STOP_MARGIN_S."""
    return max(0.0, exit_timeout_s(os.getppid() if server_pid is None else server_pid) - STOP_MARGIN_S)


def grace_warning(grace_s: float, server_pid: int | None = None) -> str | None:
    """What to tell the operator of a stop_grace_s longer than tritonserver's exit timeout leaves: the stop then runs
    out the timeout whenever requests run past the grace."""
    fits = default_grace_s(server_pid)
    if grace_s <= fits:
        return None
    return (f"stop_grace_s={grace_s:g} is longer than tritonserver's --exit-timeout-secs leaves the requests running "
            f"at a stop ({fits:g} s, after the model's own {STOP_MARGIN_S:g} s): a stop with requests still running "
            f"then runs out that timeout")


class ServerStopWatch:
    """Asks whether this model still serves; says when the requests running must end, and why."""

    def __init__(self, pb_utils, model_name: str, model_version: str = "", *, grace_s: float, check_s: float = 0.5):
        self.pb, self.model_name, self.model_version = pb_utils, model_name, model_version
        self.grace_s, self.check_s = grace_s, check_s
        self.next_check = 0.0
        self.reason: str | None = None  # why the model no longer serves (None: it does, as far as seen)
        self.since: float | None = None  # when that was seen (time.monotonic())
        self.failures = 0  # asks in a row that failed saying nothing of a stop
        self.last_failure = ""
        self.enabled = hasattr(pb_utils, "is_model_ready")  # (a Python backend without it: never asked)

    def check(self, now: float) -> str | None:
        """Ask for the model's readiness, if due and no stop has been seen. A failure that says nothing of a stop is
        asked again later, backing off (each ask could be one made during a stop), and returned when it differs from
        the last one, for the caller to log."""
        if not self.enabled or now < self.next_check or self.since is not None:
            return None
        self.next_check = now + self.check_s
        try:
            ready = self.pb.is_model_ready(self.model_name, self.model_version)
            reason = None if ready else "the model is being unloaded"
        except Exception as exc:
            reason = stop_reason(str(exc))
            if reason is None:
                return self._failed(now, f"cannot tell whether the model still serves: {exc}")
        self.failures = 0
        if reason is not None:
            self.reason, self.since = reason, now
        return None

    def _failed(self, now: float, failure: str) -> str | None:
        self.failures += 1
        self.next_check = now + min(self.check_s * 2 ** min(self.failures, 16), max(self.check_s, MAX_CHECK_INTERVAL_S))
        if failure == self.last_failure:
            return None
        self.last_failure = failure
        return failure

    def must_end(self, now: float) -> bool:
        """Whether the requests still running must end now: the stop has lasted its grace."""
        return self.since is not None and now - self.since >= self.grace_s

    def message(self) -> str:
        return f"{self.reason}: the request was ended unfinished {self.grace_s:g} s after that (stop_grace_s)"


def stop_reason(error: str) -> str | None:
    """What an is_model_ready failure says of a stop: tritonserver's ModelIsReady answers "Server not ready" once it
    stops; its GetModel, "... is not at ready state" / "is not found" / "has no available versions" once the model
    unloads. None for anything else (a failure to ask)."""
    if "Server not ready" in error:
        return "tritonserver is stopping"
    if any(words in error for words in ("not at ready state", "is not found", "has no available versions")):
        return "the model is being unloaded"
    return None
