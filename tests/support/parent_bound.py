"""Run a command that ends with the test run that started it: ``python -m tests.support.parent_bound PID COMMAND…``.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) outlives ``exec``: the command
gets SIGTERM when PID, its parent, ends, however it ends (a pytest run killed with SIGKILL
too), so a ``runworkers`` that a test started never outlives the run and keeps its host's
lease. The command replaces this process (same pid, no wrapper left). The signal comes
when the parent's *thread* that started the command ends: start it from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the signal was asked for: no one would send it
        raise SystemExit(f"parent {parent} is gone; not starting {command[0]}")
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
