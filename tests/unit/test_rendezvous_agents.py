"""A rendezvous in one process, without MPI: a server and agents on loopback addresses
127.0.0.1-3 (each agent its own --local-addr, as three machines would have), the commands
an MPI launcher would send, lost nodes, timeouts, our ssh and the session sweep."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mpitrain.runner.launcher_report import (
    DAEMON_GONE,
    DAEMON_LOST,
    OutputWatch,
    lost_daemon_message,
)
from mpitrain.runner.rdzv_agent import NodeAgent, RendezvousFailed, exit_code
from mpitrain.runner.rdzv_server import RendezvousServer
from mpitrain.runner.rdzv_session import kill_session, session_members
from mpitrain.runner.rdzv_shell import RemoteShell
from support import ROOT

pytestmark = pytest.mark.timeout(120)


def _loopback_ok() -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.3", 0))
            return True
        except OSError:
            return False


needs_loopback = pytest.mark.skipif(not _loopback_ok(),
                                    reason="127.0.0.3 cannot be bound on this machine")


class Rendezvous:
    """A server on 127.0.0.1 and agents that join it from 127.0.0.(i+1), each in a thread."""

    def __init__(self, nnodes: int, timeout_s: float = 20, heartbeat_s: float = 5,
                 secret: bytes = b"", rdzv_id: str = "t") -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.lines: list[str] = []
        self.server = RendezvousServer(self.listener, rdzv_id, secret, nnodes, timeout_s,
                                       heartbeat_s, self.lines.append)
        self.nnodes, self.timeout_s, self.heartbeat_s = nnodes, timeout_s, heartbeat_s
        self.secret, self.rdzv_id = secret, rdzv_id
        self.results: dict[int, object] = {}
        self.agents: dict[int, NodeAgent] = {}
        self.threads: list[threading.Thread] = []

    def agent(self, index: int, rank: int | None = None, nnodes: int | None = None,
              secret: bytes | None = None, rdzv_id: str | None = None, serve: bool = False,
              env: dict[str, str] | None = None) -> NodeAgent:
        agent = NodeAgent("127.0.0.1", self.port, rdzv_id or self.rdzv_id,
                          self.secret if secret is None else secret, nnodes or self.nnodes, 2,
                          rank, index == 0, time.monotonic() + self.timeout_s,
                          self.heartbeat_s, env or dict(os.environ), self.lines.append,
                          local_addr=f"127.0.0.{index + 1}")
        if index == 0:
            self.server.start(agent.id)
        self.agents[index] = agent

        def run() -> None:
            try:
                assignment = agent.join()
                self.results[index] = agent.serve() if serve else assignment
            except RendezvousFailed as exc:
                self.results[index] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        return agent

    def wait(self, *indexes: int, timeout: float = 30) -> None:
        limit = time.monotonic() + timeout
        while not all(i in self.results for i in indexes):
            assert time.monotonic() < limit, f"agents {indexes} hang: {self.lines}"
            time.sleep(0.02)


def _fake_daemon(tmp: Path, body: str) -> str:
    """A program called prted (so the agent accepts it) doing ``body``; its command line as
    PRRTE would write it."""
    program = tmp / "prted"
    program.write_text(f"#!/bin/sh\n{body}\n")
    program.chmod(0o755)
    return f"PRTE_PREFIX={tmp};export PRTE_PREFIX;{program} --prtemca ess \"env\""


@needs_loopback
def test_all_nodes_join_and_get_the_same_node_list():
    r = Rendezvous(3)
    r.agent(0)
    r.agent(2)
    r.agent(1)
    r.wait(0, 1, 2)
    got = [r.results[i] for i in range(3)]
    assert [a.rank for a in got] == [0, 1, 2]  # serving first, then by address/name
    assert {tuple(n.addr for n in a.nodes) for a in got} == {("127.0.0.1", "127.0.0.2",
                                                               "127.0.0.3")}
    assert {a.launcher for a in got} == {0}
    assert r.server.runs_launcher()
    r.server.finish(0)


@needs_loopback
def test_a_node_rank_that_never_comes_is_named_at_the_timeout():
    r = Rendezvous(3, timeout_s=1.5)
    start = time.monotonic()
    r.agent(0, rank=0)
    r.agent(1, rank=1)
    r.wait(0, 1)
    assert time.monotonic() - start < 1.5 + 3
    for i in (0, 1):
        assert isinstance(r.results[i], RendezvousFailed)
        assert "node rank(s) 2 did not arrive within the --rdzv-timeout (1.5 s); 2 of 3 " \
               "joined" in str(r.results[i])


@needs_loopback
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(rank=0), "asks for --node-rank 0, which node"),
    (dict(nnodes=4), "was started with --nnodes 4, the rendezvous with --nnodes 3"),
    (dict(rdzv_id="other"), "serves rendezvous id 't', not 'other'"),
    (dict(secret=b"x"), "could not prove that it knows this node's MPITRAIN_RDZV_SECRET"),
])
def test_an_agent_that_does_not_belong_is_turned_away(kwargs, message):
    r = Rendezvous(3)
    r.agent(0, rank=0)
    time.sleep(0.3)
    r.agent(1, **kwargs)
    r.wait(1)
    assert isinstance(r.results[1], RendezvousFailed) and message in str(r.results[1])
    assert 0 not in r.results  # the rendezvous itself goes on waiting
    r.server.finish(1, "test over")
    r.wait(0)


@needs_loopback
def test_an_agent_after_the_job_started_is_told_it_came_too_late():
    r = Rendezvous(1)
    r.agent(0)
    r.wait(0)
    late = Rendezvous(1)
    late.port = r.port  # same endpoint, same id: a restarted agent, say
    late.agent(1)
    late.wait(1)
    late.listener.close()
    assert "came too late: rendezvous 't' is complete" in str(late.results[1])
    r.server.finish(0)


@needs_loopback
def test_daemon_commands_run_on_their_node_and_their_exit_code_comes_back(tmp_path):
    r = Rendezvous(2)
    r.agent(0, serve=True)
    r.agent(1, serve=True, env={**os.environ, "MARK": str(tmp_path / "ran")})
    r.server.wait_assembled()
    ok = _fake_daemon(tmp_path, 'echo "$@" > "$MARK"; exit 3')
    assert r.server.launch("127.0.0.2", ok, threading.Event()) == 3
    assert (tmp_path / "ran").read_text().strip() == "--prtemca ess env"
    # Not a daemon: refused by the node's agent, ssh's failure code back.
    assert r.server.launch("127.0.0.2", "touch /tmp/pwned", threading.Event()) == 255
    assert any("refused to run a command" in line for line in r.lines)
    # No such node.
    assert r.server.launch("10.9.9.9", ok, threading.Event()) == 255
    # The launcher gave up on a command: the node stops it.
    cancelled = threading.Event()
    slow = _fake_daemon(tmp_path, "exec sleep 60")
    threading.Timer(0.5, cancelled.set).start()
    start = time.monotonic()
    assert r.server.launch("127.0.0.2", slow, cancelled) == exit_code(-signal.SIGTERM)
    assert time.monotonic() - start < 10
    r.server.finish(0)
    r.wait(0, 1)
    assert r.results == {0: 0, 1: 0}


@needs_loopback
def test_a_lost_node_is_reported_and_the_failure_reaches_every_agent(tmp_path):
    r = Rendezvous(3)
    lost: list[tuple[str, str]] = []
    for i in range(3):
        r.agent(i, serve=True)
    assert r.server.wait_assembled()
    r.server.on_lost = lambda who, why: lost.append((who, why))
    r.agents[2].stop("stopped by SIGTERM", 143)
    r.wait(2)
    assert isinstance(r.results[2], RendezvousFailed) and r.results[2].code == 143
    limit = time.monotonic() + 10
    while not lost and time.monotonic() < limit:
        time.sleep(0.05)
    assert lost and lost[0][0] == f"node 2 ({socket.gethostname()}, 127.0.0.3)"
    r.server.finish(1, f"{lost[0][0]} was lost: {lost[0][1]}")
    r.wait(0, 1)
    for i in (0, 1):
        assert isinstance(r.results[i], RendezvousFailed) and r.results[i].code == 1
        assert "the job failed: node 2" in str(r.results[i])


@needs_loopback
def test_agents_give_up_a_server_that_dies():
    r = Rendezvous(2, heartbeat_s=2)
    r.agent(0)
    r.agent(1, serve=True)
    r.wait(0)
    assert r.results[0].rank == 0
    # The serving process vanishes: its connections close (the silent case is the
    # heartbeat's, tested on the link itself).
    for member in r.server.members:
        member.link.channel.sock.shutdown(socket.SHUT_RDWR)
    r.wait(1)
    assert "lost the rendezvous server, node 0" in str(r.results[1])


def test_a_signal_while_waiting_for_the_server_ends_the_agent_at_once():
    # Nobody listens on this port: the agent keeps retrying until its (long) timeout...
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = NodeAgent("127.0.0.1", port, "t", b"", 2, 1, None, False, time.monotonic() + 600,
                      5, {}, lambda line: None)
    threading.Timer(0.5, agent.stop, ("stopped by SIGTERM", 143)).start()
    start = time.monotonic()
    with pytest.raises(RendezvousFailed) as info:
        agent.join()
    # ...unless stopped, which ends it within one pause between tries.
    assert time.monotonic() - start < 3
    assert info.value.code == 143 and "stopped by SIGTERM while joining" in str(info.value)


# -- our ssh ------------------------------------------------------------------------------------
def test_our_ssh_hands_the_command_over_and_exits_with_its_code():
    calls: list[tuple[str, str]] = []

    def launch(host: str, command: str, cancelled: threading.Event) -> int:
        calls.append((host, command))
        return 7

    with RemoteShell(launch) as shell:
        assert oct(os.stat(shell.dir).st_mode & 0o777) == "0o700"
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        result = subprocess.run([shell.program, "-x", "10.0.0.2", "PRTE_PREFIX=/v;", "prted",
                                 "--a", "b"], env=env, timeout=60)
    assert result.returncode == 7
    assert calls == [("10.0.0.2", "PRTE_PREFIX=/v; prted --a b")]
    assert not os.path.exists(shell.dir)


def test_killing_our_ssh_cancels_the_command():
    cancelled_seen = threading.Event()
    started = threading.Event()

    def launch(host: str, command: str, cancelled: threading.Event) -> int:
        started.set()
        if cancelled.wait(30):
            cancelled_seen.set()
        return 255

    with RemoteShell(launch) as shell:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.Popen([shell.program, "h", "prted"], env=env)
        assert started.wait(30)
        proc.kill()
        proc.wait(10)
        assert cancelled_seen.wait(10)


def test_our_ssh_without_its_server_fails_like_ssh(tmp_path):
    program = ROOT / "src" / "mpitrain" / "runner" / "rdzv_ssh.py"
    result = subprocess.run([sys.executable, "-S", "-E", str(program), "--socket",
                             str(tmp_path / "none.sock"), "h", "prted"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 255 and "cannot reach the rendezvous server" in result.stderr


# -- the session sweep ----------------------------------------------------------------------------
def test_processes_left_in_a_session_are_found_and_ended():
    # A "daemon" with a "rank" in a process group of its own (as Open MPI's daemon puts
    # them) and a child in its own group; the daemon dies hard.
    rank = f"{sys.executable} -c 'import os, time; os.setpgid(0, 0); time.sleep(300)'"
    leader = subprocess.Popen(["/bin/sh", "-c", f"{rank} & sleep 300; wait"],
                              start_new_session=True)
    def own_group() -> list[int]:
        """Members that have moved to a group of their own (the "rank", once set up)."""
        out = []
        for pid in session_members(leader.pid):
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) != leader.pid:
                    out.append(pid)
        return out

    limit = time.monotonic() + 30
    # Until the "rank" has called setpgid, killing the daemon's group would take it too.
    while (len(session_members(leader.pid)) < 3 or not own_group()) and \
            time.monotonic() < limit:
        time.sleep(0.05)
    assert len(session_members(leader.pid)) == 3 and len(own_group()) == 1
    leader.kill()
    leader.wait()
    os.killpg(leader.pid, signal.SIGKILL)  # the daemon's group: not enough
    time.sleep(0.2)
    left = session_members(leader.pid)
    assert len(left) == 1 and os.getpgid(left[0]) != leader.pid  # orphaned, other group
    assert kill_session(leader.pid) == 1
    limit = time.monotonic() + 10
    while session_members(leader.pid) and time.monotonic() < limit:
        time.sleep(0.05)
    assert session_members(leader.pid) == []


# -- the launcher's last words ----------------------------------------------------------------
def test_a_lost_daemon_is_noticed_even_across_chunks_and_everything_is_copied():
    read_end, write_end = os.pipe()
    copied = io.BytesIO()
    watch = OutputWatch(os.fdopen(read_end, "rb", buffering=0), copied)
    text = b"rank output\n" + DAEMON_LOST + b" ... will terminate the job\n"
    cut = 12 + len(DAEMON_LOST) // 2
    os.write(write_end, text[:cut])
    time.sleep(0.2)  # two reads: the marker straddles them
    assert not watch.daemon_lost.is_set()
    os.write(write_end, text[cut:])
    os.close(write_end)
    watch.join(10)
    assert watch.daemon_lost.is_set() and copied.getvalue() == text
    assert watch.lost_node is None  # this report did not name the node


def test_the_lost_daemons_node_is_named_when_open_mpi_says_it():
    read_end, write_end = os.pipe()
    watch = OutputWatch(os.fdopen(read_end, "rb", buffering=0), io.BytesIO())
    os.write(write_end, DAEMON_LOST + b".\n\n  HNP daemon   : [prterun-vm-1@0,0] on node vm\n"
             b"  Remote daemon: [prterun-vm-1@0,2] on node mt1-node2\n")
    os.close(write_end)
    watch.join(10)
    assert watch.daemon_lost.is_set() and watch.lost_node == "mt1-node2"
    assert "the daemon of node mt1-node2" in lost_daemon_message("mpitrainrun", watch.lost_node)


def test_a_daemon_whose_remote_shell_ended_counts_as_lost_with_its_node():
    read_end, write_end = os.pipe()
    watch = OutputWatch(os.fdopen(read_end, "rb", buffering=0), io.BytesIO())
    os.write(write_end, b"-----\n" + DAEMON_GONE + b". This could\nbe due to ... back to "
             b"prterun:\n\n  Local host:    vm\n  Remote host:   mt1-node2\n"
             b"  Daemon exit status: 0\n")
    os.close(write_end)
    watch.join(10)
    assert watch.daemon_lost.is_set() and watch.lost_node == "mt1-node2"


def test_ordinary_launcher_output_is_no_lost_daemon():
    read_end, write_end = os.pipe()
    watch = OutputWatch(os.fdopen(read_end, "rb", buffering=0), io.BytesIO())
    os.write(write_end, b"prterun detected that one or more processes exited\n")
    os.close(write_end)
    watch.join(10)
    assert not watch.daemon_lost.is_set()
