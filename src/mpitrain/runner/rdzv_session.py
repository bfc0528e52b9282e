"""Processes left behind by an MPI launcher or daemon, found by their session and ended.

The agents start the MPI launcher and each daemon in a session of its own.  The ranks those
start are each put in a process group of their own (Open MPI's daemons do that), so signalling
the launcher's or daemon's process group does not reach them, and when the launcher or daemon
dies hard they are left running, reparented to init.  They stay in its session, though, and
the session id is the launcher's or daemon's pid: scanning ``/proc`` for it finds them all,
also after their parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PROC = Path("/proc")


def session_members(sid: int, proc: Path = PROC) -> list[int]:
    """The pids of the live processes in session ``sid`` (Linux; empty elsewhere).  Zombies
    are dead already (waiting for a parent, or an init that may never reap them) and left
    out."""
    found = []
    for entry in proc.glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def kill_session(sid: int, sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every process of session ``sid`` but this one; return how many."""
    count = 0
    for pid in session_members(sid):
        if pid == os.getpid():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            count += 1
    return count


__all__ = ["kill_session", "session_members"]
