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

import sys
import threading
from typing import IO

# Open MPI (PRRTE) 5.0's help text when a daemon goes away.
DAEMON_LOST = b"PRTE has lost communication with a remote daemon"


class StderrWatch:
    """Copy ``stream`` to this process's stderr in a thread, noting whether the launcher
    reported a lost daemon."""

    def __init__(self, stream: IO[bytes], out: IO[bytes] | None = None) -> None:
        self.stream = stream
        self.out = out if out is not None else sys.stderr.buffer
        self.daemon_lost = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="launcher-stderr", daemon=True)
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
            # The marker may straddle two chunks.
            if DAEMON_LOST in tail + chunk:
                self.daemon_lost.set()
            tail = (tail + chunk)[-len(DAEMON_LOST):]

    def join(self, timeout_s: float) -> None:
        """Wait (bounded: a rank that inherited the pipe may keep it open) for the copy."""
        self._thread.join(timeout_s)


def lost_daemon_message(launcher: str) -> str:
    return (f"{launcher}: Open MPI lost a node's daemon and ended the job before the ranks "
            "finished (it exits 0 even so); reporting failure")


__all__ = ["DAEMON_LOST", "StderrWatch", "lost_daemon_message"]
