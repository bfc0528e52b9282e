"""The MPI launcher's stderr: copied through as it comes, and watched for Open MPI's word
that it ended the job because a node's daemon was lost.

With elastic options the launcher is let go on when a node is lost, since ULFM lets the
surviving ranks continue when a *rank* dies.  When a whole node goes, its daemon with it,
Open MPI 5.0.11 instead prints "PRTE has lost communication with a remote daemon ... will
terminate the job" and then exits 0, although the ranks never finished (seen on the
namespace cluster, 2026-11-28, under plain mpirun as well).  An exit status of 0 after that is
no success: neither ``mpitrainrun`` nor the rendezvous agents report one.
"""

from __future__ import annotations

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


class OutputWatch:
    """Copy one of the launcher's output streams to ``out`` (this process's stderr unless
    given) in a thread, noting whether the launcher reported a lost daemon there (PRRTE writes
    some of its reports to stdout, some to stderr: watch both, :func:`watch_launcher`)."""

    def __init__(self, stream: IO[bytes], out: IO[bytes] | None = None) -> None:
        self.stream = stream
        self.out = out if out is not None else sys.stderr.buffer
        self.daemon_lost = threading.Event()
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

    def join(self, timeout_s: float) -> None:
        """Wait for both copies, ``timeout_s`` in all."""
        end = time.monotonic() + timeout_s
        for watch in self.watches:
            watch.join(max(0.0, end - time.monotonic()))


def lost_daemon_message(launcher: str, node: str | None = None) -> str:
    which = f"the daemon of node {node}" if node else "a node's daemon"
    # Said whatever the ranks on the other nodes did: Open MPI ends the job when the daemon
    # goes, sometimes after the survivors finished, sometimes before, and may exit 0 either
    # way; the launcher cannot tell the two apart, so it never reports success.
    return (f"{launcher}: Open MPI lost {which} and ended the job (it may exit 0 even so); "
            "the ranks on the other nodes may or may not have finished; reporting failure "
            "(elastic training survives lost ranks in place, but Open MPI 5.0 ends the whole "
            "job when a node's daemon goes)")


__all__ = ["DAEMON_GONE", "DAEMON_LOST", "LauncherWatch", "OutputWatch", "lost_daemon_message"]
