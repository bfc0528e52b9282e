"""``mpitrainrun --rdzv-endpoint``: one agent per node, a rendezvous, one MPI job across them.

On a cluster that starts the same command once per node and offers no MPI launcher (HPC Pack
node tasks, Kubernetes Jobs, AWS Batch multi-node jobs, Slurm without PMI), every node runs
this agent:

1. The agent whose machine owns the endpoint's address (or that has ``--node-rank 0``) serves
   the rendezvous (:mod:`.rdzv_server`); every agent, that one too, joins it as a client
   (:mod:`.rdzv_agent`) and says who it is.  Once all ``--nnodes`` have come the server fixes
   the node ranks.
2. The serving agent runs the MPI launcher over the nodes' addresses, with our ssh
   (:mod:`.rdzv_ssh`, :mod:`.rdzv_shell`) as its remote-launch program: each node's daemon
   command travels over the rendezvous connection to that node's agent, which checks it
   (:mod:`.rdzv_command`) and starts it.  From there on it is an ordinary MPI job: ranks,
   local ranks, the topology are the launcher's.
3. When the launcher exits, every agent is told the exit code and exits with it.  A node
   lost during the job (its connection closed, or silent for the heartbeat timeout) ends the
   job, unless elastic options let the survivors go on (ULFM); every agent then exits non-zero
   with a message naming the node.
"""

from __future__ import annotations

import errno
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from .launcher_report import LauncherWatch, wait_bounded
from .mpi_command import Flavor
from .rdzv_agent import NodeAgent, RendezvousFailed, exit_code
from .rdzv_options import RendezvousOptions
from .rdzv_server import RendezvousServer
from .rdzv_session import kill_session
from .rdzv_shell import RemoteShell
from .rdzv_wire import SECRET_VARIABLE, secret_from
from .signals import on_signals

# When a node is lost, the MPI launcher usually notices too and ends the job itself, which is
# the cleanest end; it gets this long before SIGTERM, and as long again before SIGKILL.
LAUNCHER_GRACE_S = 5.0
# Resource managers whose allocation Open MPI would otherwise read (and whose node names the
# rendezvous's addresses would not match); excluding one that is not built in is harmless.
_OMPI_RAS_EXCLUDED = "^slurm,pbs,tm,lsf,gridengine,alps,flux"


def launcher_args(flavor: Flavor, program: str) -> list[str]:
    """The MPI launcher's arguments that make ``program`` its ssh and keep it off any
    scheduler's own launch and node list."""
    if flavor is Flavor.OPENMPI:
        # No tree spawn: otherwise daemons on other nodes would start further daemons
        # through our ssh, which only exists on the serving node.
        return ["--prtemca", "plm", "ssh", "--prtemca", "plm_ssh_agent", program,
                "--prtemca", "plm_ssh_no_tree_spawn", "1", "--prtemca", "ras",
                _OMPI_RAS_EXCLUDED]
    if flavor is Flavor.MPICH:
        return ["-launcher", "ssh", "-launcher-exec", program, "-rmk", "user"]
    return ["-bootstrap", "ssh", "-bootstrap-exec", program, "-rmk", "user"]


def host_list(addrs: Sequence[tuple[str, int]]) -> str:
    """``addr:slots,...`` in node-rank order."""
    return ",".join(f"{addr}:{slots}" for addr, slots in addrs)


def _log_to_stderr(line: str) -> None:
    print(f"mpitrainrun[{socket.gethostname()}]: {line}", file=sys.stderr, flush=True)


def is_local_address(host: str) -> bool:
    """Whether ``host`` resolves to an address of this machine (one we can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def listen(opts: RendezvousOptions) -> socket.socket | None:
    """The server's socket on the endpoint's port (every address, as torch's TCPStore), or
    None when the port is taken, by another job's server or an earlier agent: this agent then
    joins whoever holds it, and the rendezvous id decides whether that is its job.

    Raises:
        ValueError: the port cannot be bound for another reason (say, a privileged port).
    """
    family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("", opts.port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise ValueError(f"cannot serve the rendezvous on port {opts.port}: "
                         f"{exc.strerror or exc}") from None
    sock.listen(128)
    return sock


def serves(opts: RendezvousOptions) -> bool:
    """Whether this agent should serve the endpoint (torch's c10d rule, plus node rank 0 for
    endpoints such as a Kubernetes Service whose address belongs to no node)."""
    if opts.is_host is not None:
        return opts.is_host
    return opts.node_rank == 0 or is_local_address(opts.host)


def run(opts: RendezvousOptions, environ: Mapping[str, str], flavor: Flavor,
        plan_argv: Callable[[str, int, str], list[str]], elastic: bool, verbose: bool,
        log: Callable[[str], None] = _log_to_stderr) -> int:
    """Be this node's agent; return its exit code (the job's, or non-zero with a message).

    Args:
        plan_argv: ``f(hosts, np, ssh_program) -> argv`` of the MPI launcher.
        elastic: the job continues in place when a node is lost (ULFM).
    """
    secret = secret_from(environ)
    if not secret:
        log(f"{SECRET_VARIABLE} is not set: anything that can reach {opts.endpoint} can join "
            "this rendezvous or pose as its server (docs/guide/rendezvous.md, Security)")
    # What daemons and ranks see: the secret stays with the agents.
    job_env = {k: v for k, v in environ.items() if k != SECRET_VARIABLE}
    deadline = time.monotonic() + opts.timeout_s
    listener = listen(opts) if serves(opts) else None
    server = (RendezvousServer(listener, opts.rdzv_id, secret, opts.nnodes, opts.timeout_s,
                               opts.heartbeat_timeout_s, log) if listener else None)
    agent = NodeAgent(opts.host, opts.port, opts.rdzv_id, secret, opts.nnodes, opts.nproc,
                      opts.node_rank, server is not None, deadline, opts.heartbeat_timeout_s,
                      job_env, log, opts.local_addr)
    if server is not None:
        server.start(agent.id)
        log(f"serving rendezvous {opts.rdzv_id!r} for {opts.nnodes} node(s) on port "
            f"{opts.port}")

    def stop(signum: int) -> None:
        agent.stop(f"stopped by {signal.Signals(signum).name}", 128 + signum)

    try:
        with on_signals(stop):
            assignment = agent.join()
    except RendezvousFailed as exc:
        log(str(exc))
        if server is not None:
            server.finish(exc.code, str(exc))
        return exc.code
    me = assignment.name(assignment.rank)
    first = sum(n.nproc for n in assignment.nodes[:assignment.rank])
    log(f"all {opts.nnodes} node(s) joined; this is {me}, ranks {first}-{first + opts.nproc - 1}")
    if server is None or not server.runs_launcher():
        if server is not None:
            server.close()
        log(f"the job's output appears on {assignment.name(assignment.launcher)}, which runs "
            "the MPI launcher")
        try:
            with on_signals(stop):
                code = agent.serve()
        except RendezvousFailed as exc:
            log(str(exc))
            return exc.code
        log(f"the job finished (exit {code})")
        return code
    nodes = [(n.addr, n.nproc) for n in assignment.nodes]
    return _launch(server, me, nodes, plan_argv, job_env, elastic, verbose, log)


def _launch(server: RendezvousServer, me: str, nodes: list[tuple[str, int]],
            plan_argv: Callable[[str, int, str], list[str]], job_env: Mapping[str, str],
            elastic: bool, verbose: bool, log: Callable[[str], None]) -> int:
    """Run the MPI launcher over ``nodes``; end it when a node is lost (unless elastic);
    tell every agent the outcome; return the exit code."""
    # Lost nodes, and (None, None) when the launcher has exited: one queue, so that the loop
    # below wakes at once for either.
    events: queue.Queue[tuple[str | None, str | None]] = queue.Queue()
    server.on_lost = lambda who, why: events.put((who, why))
    failure: str | None = None
    stopped: list[str] = []
    gone: list[str] = []  # nodes an elastic job went on without
    with RemoteShell(server.launch) as shell:
        argv = plan_argv(host_list(nodes), sum(k for _, k in nodes), shell.program)
        if verbose:
            log(shlex.join(argv))
        try:
            # A session of its own, so that ranks it leaves behind can be found (rdzv_session).
            proc = subprocess.Popen(argv, env=dict(job_env), start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except OSError as exc:
            failure = f"cannot start the MPI launcher {argv[0]!r}: {exc}"
            log(failure)
            server.finish(1, failure)
            return 1

        def forward(signum: int) -> None:
            stopped.append(f"{me} was stopped by {signal.Signals(signum).name}")
            proc.send_signal(signum)  # mpirun ends the job on every node

        report = LauncherWatch(proc)

        def exited() -> None:
            wait_bounded(proc, report, "mpitrainrun")  # bounded once Open MPI ends the job
            events.put((None, None))

        threading.Thread(target=exited, name="rdzv-launcher-wait", daemon=True).start()
        with on_signals(forward):
            while True:
                who, why = events.get()
                if who is None:
                    break  # the launcher exited
                if failure is not None:
                    continue  # already ending it
                if elastic:
                    log(f"{who} was lost ({why}); the job goes on without it (elastic)")
                    gone.append(who)
                    continue
                failure = f"{who} was lost: {why}"
                log(f"{failure}; ending the job")
                threading.Thread(target=_end, args=(proc,), name="rdzv-end",
                                 daemon=True).start()
            code = exit_code(proc.wait())
            kill_session(proc.pid)
        report.join(LAUNCHER_GRACE_S)
    if failure is None and gone and report.daemon_lost:
        failure = (f"{gone[0]} was lost and Open MPI ended the job (a lost node's daemon ends "
                   f"it even with ULFM), although it exited {code}")
    if failure is None and code != 0:
        # A node lost as the launcher ended (it may have noticed first) is the reason.
        limit = time.monotonic() + 1.0
        while failure is None and time.monotonic() < limit:
            try:
                who, why = events.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                break
            if who is not None:
                failure = f"{who} was lost: {why}"
    if failure is None and stopped:
        failure = stopped[0]
    if failure is not None:
        code = code or 1
    elif code != 0:
        failure = (f"the MPI launcher on {me} exited with {code}; its report, and the ranks' "
                   "output, are in that node's output")
    log(f"the job failed: {failure}" if failure else "the job finished (exit 0)")
    server.finish(code, failure)
    return code


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Let the MPI launcher end the job (it may have noticed the loss itself), ask it to,
    then make it."""
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            proc.wait(LAUNCHER_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


__all__ = ["LAUNCHER_GRACE_S", "host_list", "is_local_address", "launcher_args", "listen",
           "run", "serves"]
