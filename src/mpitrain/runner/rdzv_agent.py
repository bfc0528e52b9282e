"""A node's agent: it joins the rendezvous, then starts on this node the daemons that the job's
MPI launcher asks for (as sshd would), and ends when the server says how the job ended, or
when the server is lost.

Every way out is bounded: the join gives up at the agent's ``--rdzv-timeout``; once joined,
the server's verdict comes by then (it fails the rendezvous at the earliest deadline among
its agents) or the agent gives up a few seconds later; during the job, a server that goes
silent is given up after the heartbeat timeout (:mod:`.rdzv_link`).  On the way out the
agent stops the daemons it started, so no MPI process outlives it on this node.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .rdzv_command import problem
from .rdzv_link import Link
from .rdzv_nodes import Node, describe
from .rdzv_session import kill_session
from .rdzv_wire import Refused, WireError, client_handshake

# After its own deadline, a joined agent waits this much longer for the server's verdict
# (which is due by then) before giving up on the server.
VERDICT_GRACE_S = 10.0
# How long a daemon may take to exit after the job ended or after SIGTERM, before SIGKILL.
DAEMON_GRACE_S = 5.0
# Retrying a refused connection: soon at first (the serving agent is usually a moment
# behind, started by the same scheduler at the same time), then at most once a second.
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0


class RendezvousFailed(RuntimeError):
    """The rendezvous or the job failed; the message names the node(s) and says why."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Assignment:
    """The outcome of the rendezvous for this node."""

    rank: int
    nodes: list[Node]
    launcher: int  # the node rank whose agent runs the MPI launcher

    def name(self, rank: int) -> str:
        return describe(self.nodes[rank], rank)


def exit_code(returncode: int) -> int:
    """A shell's exit status for a child's return code (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


class NodeAgent:
    """Join the rendezvous at ``host:port`` as this node.

    Args:
        daemon_env: the environment daemons start with (the secret already removed).
        local_addr: the address to connect from, and so this node's address in the job
            (default: whichever the route to the endpoint uses).
    """

    def __init__(self, host: str, port: int, rdzv_id: str, secret: bytes, nnodes: int,
                 nproc: int, wanted_rank: int | None, serving: bool, deadline: float,
                 heartbeat_timeout_s: float, daemon_env: Mapping[str, str],
                 log: Callable[[str], None], local_addr: str | None = None) -> None:
        self.host, self.port = host, port
        self.where = f"{host}:{port}"
        self.rdzv_id, self.secret, self.nnodes = rdzv_id, secret, nnodes
        self.nproc, self.wanted_rank, self.serving = nproc, wanted_rank, serving
        self.deadline = deadline
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.daemon_env = dict(daemon_env)
        self.log = log
        self.local_addr = local_addr
        self.id = secrets.token_hex(8)
        self.assignment: Assignment | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._daemons: dict[int, subprocess.Popen[bytes]] = {}
        self._sessions: list[int] = []  # every daemon's session, for the leftovers
        self._lock = threading.Lock()
        self._link: Link | None = None
        self._stopped: tuple[str, int] | None = None
        self._stopping = threading.Event()  # wakes the connection retries

    # -- joining --------------------------------------------------------------------------
    def _pause(self, seconds: float) -> None:
        """Sleep between tries, unless :meth:`stop` is called meanwhile.

        Raises:
            RendezvousFailed: :meth:`stop` was called.
        """
        if self._stopping.wait(seconds) and self._stopped is not None:
            why, code = self._stopped
            raise RendezvousFailed(f"{why} while joining the rendezvous at {self.where}", code)

    def _connect(self) -> tuple[socket.socket, str]:
        """Connect to the endpoint, retrying until the deadline (its agent may start later)."""
        last: str = "not tried"
        announced = False
        pause = RETRY_FIRST_S
        while True:
            self._pause(0)
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise RendezvousFailed(f"could not reach the rendezvous at {self.where} within "
                                       f"the --rdzv-timeout (last: {last})")
            try:
                source = (self.local_addr, 0) if self.local_addr else None
                sock = socket.create_connection((self.host, self.port), timeout=min(5.0, left),
                                                source_address=source)
                return sock, sock.getsockname()[0]
            except OSError as exc:  # refused, unreachable, not resolvable yet
                if exc.errno == errno.EADDRNOTAVAIL and self.local_addr:
                    raise RendezvousFailed(f"--local-addr {self.local_addr} is not an address "
                                           "of this machine") from None
                last = exc.strerror or str(exc)
                if not announced:
                    self.log(f"waiting for the rendezvous at {self.where} ({last})")
                    announced = True
            self._pause(min(pause, max(0.0, self.deadline - time.monotonic())))
            pause = min(2 * pause, RETRY_MAX_S)

    def join(self) -> Assignment:
        """Join and wait until every node has; return this node's assignment.

        Raises:
            RendezvousFailed: refused, timed out, or the server was lost.
        """
        while True:
            sock, addr = self._connect()
            node = Node(socket.gethostname(), addr, self.nproc, self.wanted_rank, self.serving)
            hello = {**node.hello(), "nnodes": self.nnodes, "agent": self.id,
                     "timeout_left": max(0.0, self.deadline - time.monotonic())}
            try:
                channel = client_handshake(sock, self.rdzv_id, self.secret, hello, self.where)
                break
            except Refused as exc:
                sock.close()
                raise RendezvousFailed(f"{describe(node)}: {exc}") from None
            except WireError as exc:
                # Not our server yet (a port scanner, a server still starting): try again.
                sock.close()
                self.log(f"rendezvous at {self.where}: {exc}; retrying")
                self._pause(RETRY_MAX_S)
        self._link = Link(channel, self._on_message, self._on_end, self.heartbeat_timeout_s)
        self._link.start()
        limit = self.deadline + VERDICT_GRACE_S
        while True:
            try:
                kind, body = self._inbox.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                self._link.close()
                raise RendezvousFailed(f"{describe(node)}: no word from the rendezvous server "
                                       f"at {self.where} on whether all nodes came, "
                                       f"{VERDICT_GRACE_S:g} s after the --rdzv-timeout") from None
            if kind == "joined" and not self.serving:  # the server said it already
                self.log(f"joined the rendezvous at {self.where} as {describe(node)} "
                         f"({body['count']} of {body['nnodes']})")
            elif kind == "assigned":
                nodes = [Node.from_hello(n) for n in body["nodes"]]
                self.assignment = Assignment(int(body["rank"]), nodes, int(body["launcher"]))
                return self.assignment
            elif kind == "refused":  # the reason names this node
                raise RendezvousFailed(str(body["reason"]))
            elif kind == "done":
                raise RendezvousFailed(str(body.get("message") or "the rendezvous ended"),
                                       int(body.get("code") or 1))
            elif kind == "stop":
                why, code = body
                self._link.close()
                raise RendezvousFailed(f"{describe(node)}: {why}", code)
            elif kind == "lost":
                raise RendezvousFailed(f"{describe(node)}: lost the rendezvous server at "
                                       f"{self.where} while waiting for the other nodes: {body}")

    # -- the job --------------------------------------------------------------------------
    def serve(self) -> int:
        """Run daemons on request until the job ends; return this node's exit code.

        Raises:
            RendezvousFailed: the job failed or the server was lost (the daemons started
                here are stopped first).
        """
        assert self.assignment is not None and self._link is not None
        server = self.assignment.name(self.assignment.launcher)
        me = self.assignment.name(self.assignment.rank)
        try:
            while True:
                kind, body = self._inbox.get()
                if kind == "done":
                    code, message = int(body.get("code", 1)), body.get("message")
                    self._stop_daemons(DAEMON_GRACE_S)
                    if message:
                        raise RendezvousFailed(f"{me}: the job failed: {message}", code or 1)
                    return code
                if kind == "lost":
                    raise RendezvousFailed(f"{me}: lost the rendezvous server, {server}, which "
                                           f"runs the job's MPI launcher: {body}")
                if kind == "stop":
                    why, code = body
                    raise RendezvousFailed(f"{me}: {why}", code)
        finally:
            self._stop_daemons(0.0)
            self._link.close()

    def stop(self, why: str, code: int) -> None:
        """End this agent's part from another thread (a signal), with exit ``code``; the
        server learns it as a lost connection."""
        self._stopped = (why, code)
        self._stopping.set()
        self._inbox.put(("stop", (why, code)))

    # -- messages (reader thread) -----------------------------------------------------------
    def _on_message(self, message: dict[str, Any]) -> None:
        kind = message.get("t")
        if kind == "run":
            self._start(int(message["id"]), str(message["cmd"]))
        elif kind == "kill":
            with self._lock:
                proc = self._daemons.get(int(message["id"]))
            if proc is not None:
                _terminate(proc, DAEMON_GRACE_S)
        elif kind in ("joined", "assigned", "refused"):
            self._inbox.put((kind, message))
        elif kind == "done":
            self._inbox.put((kind, message))
            # The server waits for us to hang up before it closes (see RendezvousServer.finish).
            assert self._link is not None
            self._link.end("the job ended")

    def _on_end(self, why: str) -> None:
        self._inbox.put(("lost", why))

    def _start(self, key: int, command: str) -> None:
        assert self._link is not None
        reason = problem(command)
        if reason is not None:
            self.log(f"refused to run a command from the rendezvous server: {reason}: "
                     f"{command[:300]!r}")
            self._link.send({"t": "exit", "id": key, "code": 255})
            return
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                                    env=self.daemon_env, start_new_session=True)
        except OSError as exc:
            self.log(f"cannot start the MPI daemon: {exc}")
            self._link.send({"t": "exit", "id": key, "code": 255})
            return
        with self._lock:
            self._daemons[key] = proc
            self._sessions.append(proc.pid)
        threading.Thread(target=self._reap, args=(key, proc), name="rdzv-daemon",
                         daemon=True).start()

    def _reap(self, key: int, proc: subprocess.Popen[bytes]) -> None:
        code = exit_code(proc.wait())
        with self._lock:
            self._daemons.pop(key, None)
        assert self._link is not None
        self._link.send({"t": "exit", "id": key, "code": code})

    def _stop_daemons(self, grace_s: float) -> None:
        """Let the daemons exit on their own for ``grace_s``, then end them and anything
        they left behind."""
        limit = time.monotonic() + grace_s
        with self._lock:
            procs = list(self._daemons.values())
            sessions = list(self._sessions)
        for proc in procs:
            try:
                proc.wait(max(0.0, limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                _terminate(proc, DAEMON_GRACE_S)
        for sid in sessions:
            kill_session(sid)


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the daemon (which ends its ranks), then after ``grace_s`` SIGKILL whatever of
    its session is left: the ranks of a daemon that died hard (:mod:`.rdzv_session`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    kill_session(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)


__all__ = ["Assignment", "NodeAgent", "RendezvousFailed", "exit_code"]
