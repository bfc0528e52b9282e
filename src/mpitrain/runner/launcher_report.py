"""The MPI launcher's stderr: copied through as it comes, and watched for Open MPI's word
that it ended the job because a node's daemon was lost, or that it is ending the job at all.

With elastic options the launcher is let go on when a node is lost, since ULFM lets the
surviving ranks continue when a *rank* dies.  When a whole node goes, its daemon with it,
Open MPI 5.0.11 instead prints "PRTE has lost communication with a remote daemon ... will
terminate the job" and then exits 0, although the ranks never finished (seen on the
namespace cluster, 2026-11-28, under plain mpirun as well).  An exit status of 0 after that is
no success: neither ``mpitrainrun`` nor the rendezvous agents report one.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from typing import IO

# Open MPI (PRRTE) 5.0's words when a daemon goes away, each with the line naming its node:
# its errmgr's report of a daemon it lost, and its launcher's of a daemon whose remote-shell
# process (ssh, or the agent of plm_ssh_agent) ended; after either it ends the job, and after
# the second it may also exit 0 (seen on the namespace cluster when a whole host was killed).
DAEMON_LOST = b"PRTE has lost communication with a remote daemon"
DAEMON_GONE = b"A daemon failed to report back after being spawned"
_NODE_LINES = {DAEMON_LOST: re.compile(rb"Remote daemon:\s*\S+\s+on node\s+(\S+)"),
               DAEMON_GONE: re.compile(rb"Remote host:\s*(\S+)")}
_KEEP = 4096  # bytes of output kept to find the node's name after the marker
# Open MPI's words when it has decided to end the whole job: a rank exited non-zero or
# ("thus causing the job to be terminated"), a rank called MPI_Abort, a daemon was lost.
# Once said, the launcher should exit within seconds; prterun 5.0.11 was seen to stay
# forever after the first (a rank leaving with os._exit(3) while another was in MPI_Init, a
# "PMIX_ERR_UNREACH" after the report).  Elastic jobs never print these for a lost rank.
# Time the launcher gets to exit after saying it ends the job: Open MPI's own teardown (SIGTERM,
# then SIGKILL to ranks, across nodes) takes seconds; a minute is room for a loaded machine.
ENDING_GRACE_S = 60.0
JOB_ENDING = (b"causing the job to be terminated", b"MPI_ABORT was invoked", DAEMON_LOST,
              DAEMON_GONE)


class OutputWatch:
    """Copy one of the launcher's output streams to ``out`` (this process's stderr unless
    given) in a thread, noting whether the launcher reported a lost daemon there (PRRTE writes
    some of its reports to stdout, some to stderr: watch both, :func:`watch_launcher`)."""

    def __init__(self, stream: IO[bytes], out: IO[bytes] | None = None) -> None:
        self.stream = stream
        self.out = out if out is not None else sys.stderr.buffer
        self.daemon_lost = threading.Event()
        self.ending_since: float | None = None  # time.monotonic() when the job's end was said
        self.lost_node: str | None = None  # the node whose daemon was lost, once named
        self._thread = threading.Thread(target=self._copy, name="launcher-output", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        tail = b""
        while True:
            chunk = self.stream.read1(65536) if hasattr(self.stream, "read1") else \
                self.stream.read(65536)
            if not chunk:
                return
            self.out.write(chunk)
            self.out.flush()
            # The marker (and the node's line after it) may straddle chunks.
            tail = (tail + chunk)[-_KEEP:]
            if self.ending_since is None and any(m in tail for m in JOB_ENDING):
                self.ending_since = time.monotonic()
            for marker, node_line in _NODE_LINES.items():
                if marker in tail:
                    self.daemon_lost.set()
                    found = node_line.search(tail[tail.find(marker):])
                    if found and self.lost_node is None:
                        self.lost_node = found.group(1).decode(errors="replace")

    def join(self, timeout_s: float) -> None:
        """Wait (bounded: a rank that inherited the pipe may keep it open) for the copy."""
        self._thread.join(timeout_s)


class LauncherWatch:
    """Both output streams of a launcher started with ``stdout=PIPE, stderr=PIPE``, copied to
    this process's own, and what they said about lost daemons."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.watches = (OutputWatch(proc.stdout, sys.stdout.buffer),
                        OutputWatch(proc.stderr, sys.stderr.buffer))

    @property
    def daemon_lost(self) -> bool:
        return any(w.daemon_lost.is_set() for w in self.watches)

    @property
    def lost_node(self) -> str | None:
        return next((w.lost_node for w in self.watches if w.lost_node), None)

    @property
    def ending_since(self) -> float | None:
        """When (time.monotonic()) the launcher first said it is ending the job, if it did."""
        times = [w.ending_since for w in self.watches if w.ending_since is not None]
        return min(times) if times else None

    def join(self, timeout_s: float) -> None:
        """Wait for both copies, ``timeout_s`` in all."""
        end = time.monotonic() + timeout_s
        for watch in self.watches:
            watch.join(max(0.0, end - time.monotonic()))


def wait_bounded(proc: subprocess.Popen[bytes], watch: LauncherWatch, launcher: str,
                 grace_s: float = ENDING_GRACE_S) -> int:
    """Wait for the launcher to exit; once it has said it is ending the job, give it
    ``grace_s`` to do so, then end it (SIGTERM, then SIGKILL) and return 1 saying why."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=0.5)
        since = watch.ending_since
        if since is not None and time.monotonic() - since > grace_s:
            break
    print(f"{launcher}: the MPI launcher said it was ending the job {grace_s:g} s ago but has "
          "not exited (an Open MPI launcher hang); ending it and reporting failure",
          file=sys.stderr, flush=True)
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return 1


def lost_daemon_message(launcher: str, node: str | None = None) -> str:
    which = f"the daemon of node {node}" if node else "a node's daemon"
    # Said whatever the ranks on the other nodes did: Open MPI ends the job when the daemon
    # goes, sometimes after the survivors finished, sometimes before, and may exit 0 either
    # way; the launcher cannot tell the two apart, so it never reports success.
    return (f"{launcher}: Open MPI lost {which} and ended the job (it may exit 0 even so); "
            "the ranks on the other nodes may or may not have finished; reporting failure "
            "(elastic training survives lost ranks in place, but Open MPI 5.0 ends the whole "
            "job when a node's daemon goes)")


__all__ = ["DAEMON_GONE", "DAEMON_LOST", "ENDING_GRACE_S", "JOB_ENDING", "LauncherWatch",
           "OutputWatch", "lost_daemon_message", "wait_bounded"]
