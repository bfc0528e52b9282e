"""The server end of the ssh the MPI launcher runs in a rendezvous job.

Open MPI's ``plm_ssh_agent`` and MPICH's ``-launcher-exec`` accept any program called as
``PROGRAM [ssh options] HOST COMMAND...``.  Ours is a two-line script running
:mod:`.rdzv_ssh`, which hands COMMAND for HOST to this end; this end asks the rendezvous
server to have that node's agent run it, and answers with its exit code.  When the launcher
kills our ssh, the node's agent stops the command.

Our ssh reaches this end through a Unix socket in a directory that :func:`tempfile.mkdtemp`
creates for this user alone (mode 0700): the only processes that can ask for a command are
this user's on this machine, which could run it themselves anyway.  Nothing that reaches the
rendezvous port over the network can.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from .rdzv_wire import WireError, recv_json, send_json


class RemoteShell:
    """The server end: a Unix socket in a private directory, and the agent script that the
    MPI launcher is told to use instead of ssh.

    Args:
        launch: ``launch(host, command, cancelled) -> exit code``, blocking; ``cancelled`` is
            set when the launcher stops waiting for the command (it killed our ssh).
        python: the interpreter the script runs (this one).
    """

    def __init__(self, launch: Callable[[str, str, threading.Event], int],
                 python: str = sys.executable) -> None:
        program = Path(__file__).with_name("rdzv_ssh.py")
        self.launch = launch
        self.dir = tempfile.mkdtemp(prefix="mpitrain-rdzv-")
        self.socket_path = os.path.join(self.dir, "launch.sock")
        self.program = os.path.join(self.dir, "ssh")
        with open(self.program, "w") as script:
            # -S -E: our ssh needs only the standard library (see rdzv_ssh).
            script.write(f"#!/bin/sh\nexec {shlex.quote(python)} -S -E "
                         f"{shlex.quote(str(program))} --socket "
                         f"{shlex.quote(self.socket_path)} \"$@\"\n")
        os.chmod(self.program, 0o700)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(64)

    def start(self) -> RemoteShell:
        threading.Thread(target=self._accept, name="rdzv-shell", daemon=True).start()
        return self

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RemoteShell:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="rdzv-ssh",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = recv_json(conn)
                host, command = str(request["host"]), str(request["command"])
            except (WireError, KeyError):
                return  # not our script; nothing to run
            cancelled = threading.Event()

            def watch() -> None:
                # Our ssh sends nothing more: any end of its connection means the launcher
                # killed it and no longer wants the command.
                with contextlib.suppress(OSError):
                    conn.recv(1)
                cancelled.set()

            threading.Thread(target=watch, name="rdzv-ssh-watch", daemon=True).start()
            code = self.launch(host, command, cancelled)
            with contextlib.suppress(OSError):
                send_json(conn, {"code": code})


__all__ = ["RemoteShell"]
