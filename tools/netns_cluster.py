#!/usr/bin/env python3
"""A small cluster of "hosts" on one Linux machine, built from network namespaces.

Each host is a network namespace with its own address on a private /24, joined to the others by
a veth pair to one bridge, and a name in /etc/hosts.  Open MPI reaches the hosts through a
launch agent standing in for ssh: ``AGENT HOST COMMAND`` runs COMMAND in HOST's namespace and
in a fresh UTS namespace whose host name is HOST, so every rank sees its own host, MPI's
shared-memory split groups ranks per host, and cross-host traffic crosses the veth links, where
``tc`` can shape it.  Needs root, ``ip``, ``tc`` and ``unshare``.

Usage (as root, from a checkout with its .venv)::

    python tools/netns_cluster.py create --hosts 2 --slots 2 [--rate 1gbit]
    python tools/netns_cluster.py run -np 4 python -m mpitrain.face.info
    python tools/netns_cluster.py status
    python tools/netns_cluster.py destroy

``run`` hands its arguments to ``mpitrainrun`` with the cluster's hostfile and the Open MPI
flags the agent needs.  ``destroy`` removes the namespaces, links, /etc/hosts lines and the
state directory even after a crash; ``create`` first clears what a crashed run left behind.
Tests and benchmarks use :class:`Cluster` (a context manager that always cleans up).

While a cluster exists, the kernel's autogroup scheduling is off
(``/proc/sys/kernel/sched_autogroup_enabled``, restored when the last cluster is destroyed).
Each host's daemon starts a session of its own, and with autogroups on the kernel shares the
CPUs between sessions rather than between threads; with more ranks than cores that left one
rank's runnable thread without CPU for 0.3-3 s at a time (measured 2026-11-27: allreduces of
50 ms taking up to 3.4 s, on every algorithm and link; none in three runs with autogroups off).
Real hosts have their own CPUs, so this only removes an artefact of the emulation.

Shaping uses ``tbf`` (rate, burst and its queueing bound ``latency``) on each host's egress.
``netem`` is not available in every kernel (it is not on our CI machines), so no fixed delay is
added; the shaped link is a bandwidth limit with a bounded queue.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOSTS_FILE = Path("/etc/hosts")
STATE_BASE = Path(os.environ.get("MPITRAIN_NETNS_STATE", "/tmp"))

AGENT = """#!/bin/sh
# Launch agent standing in for ssh: AGENT HOST COMMAND... runs COMMAND on "host" HOST, i.e. in
# its network namespace and a private UTS namespace named after it.
host="$1"; shift
exec ip netns exec "$host" unshare --uts /bin/sh -c "hostname $host; $*"
"""


def missing_requirements(probe: bool = False) -> str | None:
    """Why a namespace cluster cannot be built here, or None when it can.

    Args:
        probe: also try to create (and remove) a network namespace, which root inside some
            containers may not be allowed to do.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces, veth links, /etc/hosts)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the '{tool}' command (iproute2 / util-linux)"
    if probe:
        name = f"mtprobe{os.getpid()}"
        made = _run(["ip", "netns", "add", name], check=False)
        _run(["ip", "netns", "del", name], check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip()}")
    return result


@contextlib.contextmanager
def _hosts_lock() -> Iterator[None]:
    with open(STATE_BASE / ".mpitrain-netns-hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
_AUTOGROUP_SAVED = "mpitrain-netns-autogroup"  # the value to restore, in STATE_BASE


def _autogroups_off() -> None:
    """Turn autogroup scheduling off (see the module docstring), remembering the value to
    restore once; nothing to do on kernels without it."""
    with _hosts_lock():
        try:
            current = AUTOGROUP.read_text().strip()
        except OSError:
            return
        saved = STATE_BASE / _AUTOGROUP_SAVED
        if not saved.exists():
            saved.write_text(current)
        if current != "0":
            with contextlib.suppress(OSError):
                AUTOGROUP.write_text("0")


def _autogroups_restore() -> None:
    """Put autogroup scheduling back as it was, once no cluster is left."""
    with _hosts_lock():
        saved = STATE_BASE / _AUTOGROUP_SAVED
        if not saved.exists() or any(STATE_BASE.glob("mpitrain-netns-*/state.json")):
            return
        with contextlib.suppress(OSError):
            AUTOGROUP.write_text(saved.read_text().strip())
        saved.unlink(missing_ok=True)


def _edit_hosts(tag: str, add: Sequence[str]) -> None:
    """Drop every /etc/hosts line carrying ``tag``, then append ``add`` (each tagged).

    Written in place, not renamed: in containers /etc/hosts is often a bind mount.
    """
    with _hosts_lock():
        lines = HOSTS_FILE.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.rstrip("\n").endswith(tag)]
        if kept and not kept[-1].endswith("\n"):
            kept[-1] += "\n"
        kept += [f"{line} {tag}\n" for line in add]
        with open(HOSTS_FILE, "r+") as handle:
            handle.seek(0)
            handle.write("".join(kept))
            handle.truncate()


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _run(["ip", "-4", "route", "show", "table", "all"], check=False).stdout
    nets = []
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast") and len(line.split()) > 1:
            first = line.split()[1]
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(first if "/" in first else f"{first}/32",
                                             strict=False))
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network)]


def _pick_subnet(name: str) -> str:
    used = _used_networks()
    start = sum(name.encode()) % 200
    for step in range(200):
        candidate = ipaddress.ip_network(f"10.231.{(start + step) % 200 + 20}.0/24")
        if not any(candidate.overlaps(n) for n in used if n.prefixlen > 0):
            return str(candidate)
    raise RuntimeError("no free 10.231.x.0/24 subnet for the namespace cluster")


@dataclass
class Cluster:
    """A namespace cluster: ``hosts`` hosts with ``slots`` slots each, named ``NAME-nodeI``.

    Use as a context manager (``with Cluster("t1") as c:``) to create it and always destroy
    it, even when the body fails.
    """

    name: str = "mtc"
    hosts: int = 2
    slots: int = 2
    subnet: str = ""
    shaped: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name.replace("-", "").isalnum() or len(self.name) > 10:
            raise ValueError(f"cluster name {self.name!r}: letters, digits and '-', at most 10 "
                             "(interface names are limited to 15 characters)")
        if not 1 <= self.hosts <= 50 or self.slots < 1:
            raise ValueError(f"hosts={self.hosts}, slots={self.slots}: need 1..50 hosts and "
                             ">= 1 slot")

    # Names of everything we create, derived from the cluster name so destroy finds leftovers.
    @property
    def hostnames(self) -> list[str]:
        return [f"{self.name}-node{i}" for i in range(1, self.hosts + 1)]

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def tag(self) -> str:
        return f"# mpitrain-netns:{self.name}"

    @property
    def state_dir(self) -> Path:
        return STATE_BASE / f"mpitrain-netns-{self.name}"

    @property
    def agent(self) -> Path:
        return self.state_dir / "agent"

    @property
    def hostfile(self) -> Path:
        return self.state_dir / "hostfile"

    def address(self, index: int) -> str:
        """Address of host ``index`` (1-based); the bridge (this machine) is .254."""
        net = ipaddress.ip_network(self.subnet)
        return str(net.network_address + index)

    def create(self) -> Cluster:
        """Build the cluster (clearing leftovers of an earlier one of the same name first).

        Raises:
            RuntimeError: a requirement is missing or a command failed (what was built so far
                is removed again).
        """
        reason = missing_requirements()
        if reason:
            raise RuntimeError(f"cannot build a namespace cluster: {reason}")
        self.destroy()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def _build(self) -> None:
        self.subnet = self.subnet or _pick_subnet(self.name)
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._save()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.address(254)}/{prefix}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for index, host in enumerate(self.hostnames, start=1):
            veth = f"{self.name}-v{index}"
            _run(["ip", "netns", "add", host])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
                  host])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.address(index)}/{prefix}", "dev",
                  "eth0"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            _run(["ip", "-n", host, "link", "set", "lo", "up"])
        _edit_hosts(self.tag, [f"{self.address(i)} {h}"
                               for i, h in enumerate(self.hostnames, start=1)])
        self.agent.write_text(AGENT)
        self.agent.chmod(0o755)
        self.hostfile.write_text("".join(f"{h} slots={self.slots}\n" for h in self.hostnames))
        _autogroups_off()

    def _save(self) -> None:
        (self.state_dir / "state.json").write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, name: str) -> Cluster:
        """The cluster ``name`` that ``create`` left running.

        Raises:
            RuntimeError: there is none.
        """
        path = STATE_BASE / f"mpitrain-netns-{name}" / "state.json"
        if not path.exists():
            raise RuntimeError(f"no namespace cluster {name!r} (run 'create' first)")
        return cls(**json.loads(path.read_text()))

    def shape(self, rate: str = "1gbit", burst: str = "128kb", latency: str = "10ms") -> None:
        """Limit every host's egress with tbf (rate, bucket size, queueing bound)."""
        for host in self.hostnames:
            _run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev", "eth0", "root",
                  "tbf", "rate", rate, "burst", burst, "latency", latency])
        self.shaped = {"rate": rate, "burst": burst, "latency": latency}
        self._save()

    def unshape(self) -> None:
        for host in self.hostnames:
            _run(["ip", "netns", "exec", host, "tc", "qdisc", "del", "dev", "eth0", "root"],
                 check=False)
        self.shaped = {}
        self._save()

    def destroy(self) -> None:
        """Remove every trace: processes in our namespaces, namespaces, links, hosts lines.

        Works from names alone, so it also cleans up after a crash; never raises for a part
        that is already gone.
        """
        existing = _run(["ip", "netns", "list"], check=False).stdout.split()
        ours = [ns for ns in existing if ns.startswith(f"{self.name}-node")]
        for ns in ours:
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            _run(["ip", "netns", "del", ns], check=False)
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        for line in links.splitlines():
            parts = line.split(":")
            if len(parts) > 1:
                dev = parts[1].strip().split("@")[0]
                if dev == self.bridge or dev.startswith(f"{self.name}-v"):
                    _run(["ip", "link", "del", dev], check=False)
        if HOSTS_FILE.exists():
            _edit_hosts(self.tag, [])
        shutil.rmtree(self.state_dir, ignore_errors=True)
        # Open MPI names its shared-memory segments after the host; a host killed whole (the
        # elastic tests do that) never removes its own.
        for segment in Path("/dev/shm").glob(f"*.{self.name}-node*"):
            segment.unlink(missing_ok=True)
        _autogroups_restore()

    def mpi_args(self) -> list[str]:
        """Open MPI flags that launch through the agent and keep traffic on the cluster."""
        return ["--prtemca", "plm_ssh_agent", str(self.agent),
                "--mca", "btl", "tcp,self,sm",
                "--mca", "btl_tcp_if_include", self.subnet,
                "--mca", "oob_tcp_if_include", self.subnet]

    def launch_argv(self, np: int, command: Sequence[str],
                    launcher_args: Sequence[str] = ()) -> list[str]:
        """The mpitrainrun command that runs ``command`` on ``np`` ranks across the hosts."""
        return [sys.executable, "-m", "mpitrain.runner.launch", "-np", str(np), "--hostfile",
                str(self.hostfile), "--mpi", "openmpi",
                "--mpi-args=" + shlex.join(self.mpi_args()), *launcher_args, *command]

    def exists(self) -> bool:
        names = _run(["ip", "netns", "list"], check=False).stdout.split()
        return all(h in names for h in self.hostnames)

    def __enter__(self) -> Cluster:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def launch_env() -> dict[str, str]:
    """Environment for a job started from a checkout: this Python first on PATH, src/
    importable, MPI never spinning."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    # 'python' in the job means this Python (e.g. the checkout's .venv), as if activated.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    return env


def _split_run(argv: list[str]) -> tuple[list[str], list[str]]:
    """Cut argv after the 'run' action: the rest belongs to mpitrainrun, options and all."""
    index = 0
    while index < len(argv):
        if argv[index] == "--name":
            index += 2
            continue
        if argv[index] == "run" and "--help" not in argv[:index] and "-h" not in argv[:index]:
            return argv[:index + 1], argv[index + 1:]
        index += 1
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="netns_cluster.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build a cluster of network-namespace hosts on this machine and run "
                    "mpitrain jobs across it (root, ip, tc and unshare needed).",
        epilog=(__doc__ or "").split("Usage", 1)[1].split("Tests and", 1)[0])
    parser.add_argument("--name", default="mtc", help="cluster name (prefix of hosts, links)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("create", help="build the cluster (replacing one of the same name)")
    p.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument("--slots", type=int, default=2, help="slots per host (default 2)")
    p.add_argument("--rate", help="shape every host's link with tbf, e.g. 1gbit")
    p.add_argument("--burst", default="128kb", help="tbf bucket (default 128kb)")
    p.add_argument("--latency", default="10ms", help="tbf queueing bound (default 10ms)")
    sub.add_parser("status", help="show hosts, addresses and shaping")
    p = sub.add_parser("run", help="run mpitrainrun across the cluster",
                       description="Everything after 'run' goes to mpitrainrun, e.g. "
                                   "'run -np 4 python -m mpitrain.face.info'.")
    p.add_argument("args", nargs="*", help="-np N [mpitrainrun options] COMMAND")
    sub.add_parser("destroy", help="remove namespaces, links, /etc/hosts lines and state")
    head, rest = _split_run(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(head)
    try:
        if args.action == "create":
            cluster = Cluster(args.name, args.hosts, args.slots).create()
            if args.rate:
                cluster.shape(args.rate, args.burst, args.latency)
            print(f"created {args.hosts} hosts on {cluster.subnet}: "
                  f"{', '.join(cluster.hostnames)}; hostfile {cluster.hostfile}")
            return 0
        if args.action == "destroy":
            Cluster(args.name).destroy()
            print(f"destroyed namespace cluster {args.name!r}")
            return 0
        cluster = Cluster.load(args.name)
        if args.action == "status":
            for i, host in enumerate(cluster.hostnames, start=1):
                print(f"{host}  {cluster.address(i)}  slots={cluster.slots}")
            print(f"shaping: {cluster.shaped or 'none'}; agent {cluster.agent}")
            return 0
        if rest[:1] == ["--"]:
            rest = rest[1:]
        argv_ = [sys.executable, "-m", "mpitrain.runner.launch", "--hostfile",
                 str(cluster.hostfile), "--mpi", "openmpi",
                 "--mpi-args=" + shlex.join(cluster.mpi_args()), *rest]
        return subprocess.call(argv_, env=launch_env())
    except (RuntimeError, ValueError) as exc:
        print(f"netns_cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
