"""`kill -USR1 PID` of a backend stub or of a worker rank prints every Python thread's stack on that process's standard
error (tritonserver's log): what a process that seems to hang is doing, without a debugger (docs/serving.md#when-the-
server-hangs). Python's `faulthandler`, which writes from its C signal handler: it answers while a thread holds the GIL,
and the process goes on afterwards."""

import faulthandler
import signal


def dump_stacks_on_sigusr1() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
