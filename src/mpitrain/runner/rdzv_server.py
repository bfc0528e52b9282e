"""The rendezvous server, run by one node's agent: it admits the job's agents, ranks the nodes
once all have come, carries the MPI launcher's daemon commands to the nodes and their exit
codes back, and tells every agent how the job ended.

Phases: *waiting* (agents join; one that leaves may come back), *assembled* (the node list is
fixed and the job runs; a node lost now is reported to the launcher through ``on_lost``),
*closing* (every agent has been told the outcome).  The server keeps listening through all
three so that a late agent, or one of another job, is told why it is turned away instead of
waiting for nothing.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .rdzv_link import Link
from .rdzv_nodes import Node, assign, describe, why_not_join
from .rdzv_wire import Channel, Refused, WireError, server_handshake

# How long the server waits, after telling every agent the outcome, for them to hang up before
# it closes their connections (closing first could reset a connection before the outcome is
# read).
CLOSING_GRACE_S = 5.0


@dataclass
class _Member:
    node: Node
    agent: str  # the agent's random id, from its hello
    deadline: float  # when this agent gives up waiting (on the server's clock)
    link: Link | None = None
    rank: int | None = None
    lost: str | None = None

    def name(self) -> str:
        return describe(self.node, self.rank)


@dataclass
class _Launch:
    member: _Member
    done: threading.Event = field(default_factory=threading.Event)
    code: int = 255  # ssh's own code for "could not run it"


class RendezvousServer:
    """Serve the rendezvous ``rdzv_id`` for ``nnodes`` agents on ``listener``.

    Args:
        listener: a bound, listening socket.
        rdzv_id, secret: what every agent must present (:mod:`.rdzv_wire`).
        nnodes: how many agents make the job.
        timeout_s: how long after now all must have come (``--rdzv-timeout``); sooner when
            an agent's own timeout ends sooner.
        heartbeat_timeout_s: silence after which an agent counts as lost.
        log: prints one line for the user.
    """

    def __init__(self, listener: socket.socket, rdzv_id: str, secret: bytes, nnodes: int,
                 timeout_s: float, heartbeat_timeout_s: float,
                 log: Callable[[str], None]) -> None:
        self.listener = listener
        self.rdzv_id = rdzv_id
        self.secret = secret
        self.nnodes = nnodes
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.log = log
        self.phase = "waiting"
        self.failure: str | None = None
        self.members: list[_Member] = []
        self.local_agent: str | None = None
        self.on_lost: Callable[[str, str], None] = lambda who, why: None
        self._cond = threading.Condition()
        self._launches: dict[int, _Launch] = {}
        self._next_launch = 0

    # -- life ---------------------------------------------------------------------------
    def start(self, local_agent: str) -> RendezvousServer:
        """Start serving; ``local_agent`` is the id the agent in this process will present
        (that agent's node is where the MPI launcher runs)."""
        self.local_agent = local_agent
        threading.Thread(target=self._accept, name="rdzv-accept", daemon=True).start()
        threading.Thread(target=self._watch_deadline, name="rdzv-deadline", daemon=True).start()
        return self

    def runs_launcher(self) -> bool:
        """Whether the rendezvous completed with this process's own agent among the nodes."""
        with self._cond:
            return self.phase == "assembled" and any(m.agent == self.local_agent
                                                    for m in self.members)

    def finish(self, code: int, message: str | None = None) -> None:
        """Tell every agent still there that the job ended with ``code`` (and why, when it
        failed), wait a little for them to hang up (the agent closes first, so that nothing
        unread on our side could reset the connection before it read the outcome), and
        close."""
        with self._cond:
            if self.phase == "closing":
                return
            self.phase = "closing"
            members = [m for m in self.members if m.link is not None and not m.lost]
            self._cond.notify_all()
        for m in members:
            assert m.link is not None
            m.link.send({"t": "done", "code": code, "message": message})
        limit = time.monotonic() + CLOSING_GRACE_S
        for m in members:
            assert m.link is not None
            m.link.wait_ended(max(0.0, limit - time.monotonic()))
            m.link.close()
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()

    def wait_assembled(self) -> bool:
        """Block until the rendezvous completed (True) or failed (False)."""
        with self._cond:
            while self.phase == "waiting":
                self._cond.wait()
            return self.failure is None and self.phase == "assembled"

    # -- admission ----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return  # closed: the job is over
            threading.Thread(target=self._admit, args=(sock, peer[0]), name="rdzv-admit",
                             daemon=True).start()

    def _admit(self, sock: socket.socket, peer: str) -> None:
        try:
            channel, hello = server_handshake(sock, self.rdzv_id, self.secret)
        except Refused as exc:
            self.log(f"turned away a connection from {peer}: {exc}")
            sock.close()
            return
        except WireError as exc:
            self.log(f"a connection from {peer} failed its handshake: {exc}")
            sock.close()
            return
        try:
            node = Node.from_hello(hello)
            nnodes, left = hello.get("nnodes"), float(hello.get("timeout_left", 0))
            agent = str(hello.get("agent", ""))
        except (TypeError, ValueError) as exc:
            self._refuse(channel, f"a malformed hello from {peer}: {exc}")
            return
        member = _Member(node, agent, time.monotonic() + left)
        link = member.link = Link(channel, lambda m: self._on_message(member, m),
                                  lambda why: self._on_end(member, why), self.heartbeat_timeout_s)
        with self._cond:
            reason = self._why_not(node, nnodes)
            if reason is None:
                self.members.append(member)
                count = len(self.members)
        if reason is not None:
            self._refuse(channel, reason)
            return
        link.start()
        link.send({"t": "joined", "count": count, "nnodes": self.nnodes})
        self.log(f"{member.name()} joined ({count} of {self.nnodes})")
        if count == self.nnodes:
            self._assemble()
        with self._cond:
            self._cond.notify_all()  # the deadline moves with each agent's own

    def _why_not(self, node: Node, nnodes: Any) -> str | None:
        if nnodes != self.nnodes:
            return (f"{describe(node)} was started with --nnodes {nnodes}, the rendezvous "
                    f"with --nnodes {self.nnodes}: give every node the same")
        if self.phase != "waiting":
            names = ", ".join(m.name() for m in self.members)
            return (f"{describe(node)} came too late: rendezvous {self.rdzv_id!r} is complete "
                    f"and its job runs on {names}")
        return why_not_join([m.node for m in self.members], node, self.nnodes)

    def _refuse(self, channel: Channel, reason: str) -> None:
        self.log(f"turned away: {reason}")
        with contextlib.suppress(WireError):  # it has gone already
            channel.send({"t": "refused", "reason": reason})
        channel.close()

    def _assemble(self) -> None:
        with self._cond:
            if self.phase != "waiting" or len(self.members) != self.nnodes:
                return
            order = assign([m.node for m in self.members])
            by_node = {id(m.node): m for m in self.members}
            self.members = [by_node[id(n)] for n in order]
            for rank, m in enumerate(self.members):
                m.rank = rank
            local = [m.rank for m in self.members if m.agent == self.local_agent]
            if not local:
                self.failure = ("the agent serving the rendezvous did not reach it through "
                                "--rdzv-endpoint (the endpoint's address leads elsewhere from "
                                "its own machine)")
            else:
                self.phase = "assembled"
            self._cond.notify_all()
        if self.failure is not None:
            self.finish(1, self.failure)
            return
        nodes = [m.node.hello() for m in self.members]
        for m in self.members:
            assert m.link is not None
            m.link.send({"t": "assigned", "rank": m.rank, "nodes": nodes, "launcher": local[0]})
        self.log("all nodes joined: " + ", ".join(m.name() for m in self.members))

    def _watch_deadline(self) -> None:
        with self._cond:
            while self.phase == "waiting":
                deadline = min([self.deadline, *(m.deadline for m in self.members)])
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            if self.phase != "waiting":
                return
            names = ", ".join(m.name() for m in self.members) or "none"
            ranks = {m.node.wanted_rank for m in self.members}
            missing = self.nnodes - len(self.members)
            if all(r is not None for r in ranks) and self.members:
                absent = sorted(set(range(self.nnodes)) - ranks)
                gone = "node rank(s) " + ", ".join(map(str, absent))
            else:
                gone = f"{missing} node(s)"
            self.failure = (f"rendezvous {self.rdzv_id!r}: {gone} did not arrive within the "
                            f"--rdzv-timeout ({self.timeout_s:g} s); {len(self.members)} of "
                            f"{self.nnodes} joined ({names})")
            self._cond.notify_all()
        # Not logged here: every agent, this process's too, prints the message it is sent.
        self.finish(1, self.failure)

    # -- the running job ---------------------------------------------------------------
    def _on_message(self, member: _Member, message: dict[str, Any]) -> None:
        if message.get("t") == "exit":
            with self._cond:
                launch = self._launches.pop(int(message["id"]), None)
            if launch is not None:
                launch.code = int(message["code"])
                launch.done.set()

    def _on_end(self, member: _Member, why: str) -> None:
        with self._cond:
            if self.phase == "closing":
                return
            if self.phase == "waiting":
                if member in self.members:
                    self.members.remove(member)
                    self.log(f"{member.name()} left before the rendezvous completed: {why}")
                self._cond.notify_all()
                return
            member.lost = why
            for key, launch in list(self._launches.items()):
                if launch.member is member:
                    del self._launches[key]
                    launch.done.set()
        self.on_lost(member.name(), why)

    def launch(self, host: str, command: str, cancelled: threading.Event) -> int:
        """Run ``command`` on node ``host`` (an address from the node list, as the MPI launcher
        names it) and return its exit code; 255 when it could not run or the node was lost.
        Setting ``cancelled`` (the launcher gave up on it) tells the node to stop it."""
        with self._cond:
            member = next((m for m in self.members if host in (m.node.addr, m.node.host)),
                          None)
            if member is None or member.lost or self.phase != "assembled":
                self.log(f"the MPI launcher asked to start a daemon on {host!r}, which is no "
                         "live node of this rendezvous")
                return 255
            key = self._next_launch
            self._next_launch += 1
            launch = self._launches[key] = _Launch(member)
        assert member.link is not None
        if not member.link.send({"t": "run", "id": key, "cmd": command}):
            return 255
        while not launch.done.wait(0.5):
            if cancelled.is_set():
                member.link.send({"t": "kill", "id": key})
                launch.done.wait(CLOSING_GRACE_S)
                break
        return launch.code


__all__ = ["CLOSING_GRACE_S", "RendezvousServer"]
