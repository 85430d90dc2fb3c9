"""What binds a test's processes to the test run that started them (``tests.support.processes``).

``python tests/support/parent_bound.py PID COMMAND…`` runs COMMAND so that it gets SIGTERM when
PID, its parent, ends, however it ends (a pytest run killed with SIGKILL too): Linux's
parent-death signal (``prctl(PR_SET_PDEATHSIG)``) outlives ``exec``, and the command replaces
this process (same pid, no wrapper left). The signal comes when the parent's *thread* that
started the command ends: only the main thread's children are bound this way.

``python tests/support/parent_bound.py --reaper PID`` is the test run's reaper: it reads the
process groups the run starts (``+PGID GRACE START`` and ``-PGID`` lines on its stdin) and, when
the run ends (its stdin closes; or PID's death signal), sends each group that is still there
SIGTERM, waits up to its GRACE seconds, then SIGKILL: the children of a child (a gateway's
serving processes, a shell's commands) end with the run too, even a child that ignores SIGTERM.

Standard library only, and run by path: it is the first thing a bound child runs, whatever
its working folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def bind_to_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask Linux for ``sig`` when this process's parent ends; refuse if ``parent`` is gone already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it ended before the signal was asked for: no one would send it
        raise SystemExit(f"parent {parent} is gone")


def start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat``'s 22nd field): with the pid, who it is."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def group_alive(pgid: int) -> bool:
    """Some process of the group is still there (and not a zombie)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def end_groups(groups: dict[int, tuple[float, str]]) -> None:
    """SIGTERM to each group, up to its grace for all of it to end, then SIGKILL to what is left.
    A group whose leader's pid now names another process (same pid, another start time) was
    ended long ago, and its number reused: left alone."""
    mine = {}
    for pgid, (grace, started) in groups.items():
        now = start_time(pgid)
        if now is not None and now != started:
            continue
        mine[pgid] = grace
    for pgid in mine:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)
    began = time.monotonic()
    while any(group_alive(pgid) and time.monotonic() - began < grace for pgid, grace in mine.items()):
        time.sleep(0.1)
    for pgid in mine:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def reap(parent: int) -> None:
    # The signals only set a flag, read between short waits: an exception raised from a handler
    # could land between a read and the parsing of what it read, and lose a group's line.
    ended = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal ended
        ended = True

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    groups: dict[int, tuple[float, str]] = {}
    pending = b""

    def read(until: float | None) -> None:
        """Take the lines on stdin until its end (the run's write end closed), ``until``
        (monotonic time; None: no limit), or, without ``until``, the run's death signal. Raw
        reads: nothing is left in a buffer unseen."""
        nonlocal pending
        fd = sys.stdin.fileno()
        while until is not None or not ended:
            wait = 0.2 if until is None else max(0.0, until - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                if until is not None:
                    return
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"+"):
                    pgid, grace, started = line[1:].decode().split()
                    groups[int(pgid)] = (float(grace), started)
                elif line.startswith(b"-"):
                    groups.pop(int(line[1:]), None)

    # A run that ended before this reaper got going (a slow start on a busy machine) has
    # still written its lines: they wait in the pipe, whose end is then the end of them.
    with contextlib.suppress(SystemExit):
        bind_to_parent(parent)
    read(until=None)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    # The run's death signal can come before its last lines were read: they are still in the
    # pipe. Read them too (a second at most, should a child of the run still hold its end).
    with contextlib.suppress(OSError, ValueError):
        read(until=time.monotonic() + 1.0)
    end_groups(groups)


def main(argv: list[str]) -> None:
    if argv[0] == "--reaper":
        reap(int(argv[1]))
        return
    parent, command = int(argv[0]), argv[1:]
    try:
        bind_to_parent(parent)
    except SystemExit:
        raise SystemExit(f"parent {parent} is gone; not starting {command[0]}") from None
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
