"""The ssh the MPI launcher runs in a rendezvous job, and its other end.

Open MPI's ``plm_ssh_agent`` and MPICH's ``-launcher-exec`` accept any program called as
``PROGRAM [ssh options] HOST COMMAND...``.  Ours (a two-line script running
``python -m mpitrain.runner.rdzv_remote --socket PATH ...``) hands COMMAND for HOST to the
rendezvous server in the launcher's own process, which passes it to that node's agent over the
rendezvous connection, and exits with the command's exit code, as ssh would; when the launcher
kills it, the node's agent stops the command.

It reaches the server through a Unix socket in a directory that :func:`tempfile.mkdtemp`
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
from collections.abc import Callable, Sequence

from .rdzv_wire import WireError, recv_json, send_json

# ssh's exit status when it cannot run the command at all.
SSH_FAILURE = 255


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
        self.launch = launch
        self.dir = tempfile.mkdtemp(prefix="mpitrain-rdzv-")
        self.socket_path = os.path.join(self.dir, "launch.sock")
        self.program = os.path.join(self.dir, "ssh")
        with open(self.program, "w") as script:
            script.write(f"#!/bin/sh\nexec {shlex.quote(python)} -m mpitrain.runner.rdzv_remote "
                         f"--socket {shlex.quote(self.socket_path)} \"$@\"\n")
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


def _split(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``--socket PATH [ssh options] HOST COMMAND...`` -> (socket, host, command words).

    Raises:
        ValueError: a part is missing.
    """
    words = list(argv)
    if len(words) < 2 or words[0] != "--socket":
        raise ValueError("usage: rdzv_remote --socket PATH [ssh options] HOST COMMAND...")
    path, words = words[1], words[2:]
    # Hydra puts ssh's -x (no X11 forwarding) before the host; ssh options take no value here.
    while words and words[0].startswith("-"):
        words.pop(0)
    if len(words) < 2:
        raise ValueError(f"no host and command in {shlex.join(argv)!r}")
    return path, words[0], words[1:]


def main(argv: Sequence[str] | None = None) -> int:
    """Run COMMAND on HOST through the rendezvous; exit with its exit code (255: could not)."""
    try:
        path, host, words = _split(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"mpitrainrun (rendezvous ssh): {exc}", file=sys.stderr)
        return SSH_FAILURE
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            # ssh joins its command words with spaces for the remote shell; so do we.
            send_json(sock, {"host": host, "command": " ".join(words)})
            answer = recv_json(sock)
        return int(answer.get("code", SSH_FAILURE))
    except (OSError, ValueError) as exc:
        print(f"mpitrainrun (rendezvous ssh): cannot reach the rendezvous server through "
              f"{path}: {exc}", file=sys.stderr)
        return SSH_FAILURE


if __name__ == "__main__":
    sys.exit(main())
