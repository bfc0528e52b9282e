#!/usr/bin/env python3
"""Startup cost of the rendezvous launch beside plain mpirun, on the same namespace hosts.

Builds a namespace cluster (tools/netns_cluster.py; 3 hosts x 2 ranks by default) and times,
round by round in turns (drift on a shared machine hits both alike), one trivial job
(``true`` on every rank) started two ways:

* ``mpirun``: ``mpitrainrun -np 6 -H host1:2,host2:2,host3:2`` run inside host 1, reaching
  the others through the cluster's ssh stand-in (the way the job starts where ssh works);
* ``rendezvous``: ``mpitrainrun --nnodes 3 --nproc-per-node 2 --rdzv-endpoint host1:PORT``
  started at the same moment inside each host (the way a scheduler starts one task per node).

Each time is from the start until the last process exits; the report gives median, p95 and
max of each, and the rendezvous's extra cost.  Run as root from a checkout with its .venv::

    .venv/bin/python benchmarks/rendezvous_startup.py              # 7 rounds
    .venv/bin/python benchmarks/rendezvous_startup.py --rounds 11 --hosts 4
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("netns_cluster", ROOT / "tools" /
                                               "netns_cluster.py")
assert _spec is not None and _spec.loader is not None
netns = importlib.util.module_from_spec(_spec)
sys.modules["netns_cluster"] = netns
_spec.loader.exec_module(netns)


def _in_host(host: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", host, "unshare", "--uts", "/bin/sh", "-c",
            f"hostname {host}; exec {shlex.join(argv)}"]


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "mpitrain.runner.launch", *args]


def time_plain(c, slots: int, command: list[str]) -> float:
    hosts = ",".join(f"{h}:{slots}" for h in c.hostnames)
    argv = _launcher("-np", str(slots * len(c.hostnames)), "-H", hosts,
                     "--mpi-args=" + shlex.join(c.mpi_args()), *command)
    start = time.monotonic()
    result = subprocess.run(_in_host(c.hostnames[0], argv), env=netns.launch_env(),
                            capture_output=True, text=True, timeout=300)
    took = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError(f"plain mpirun failed: {result.stderr[-2000:]}")
    return took


def time_rendezvous(c, slots: int, port: int, command: list[str]) -> float:
    argv = _launcher("--nnodes", str(len(c.hostnames)), "--nproc-per-node", str(slots),
                     "--rdzv-endpoint", f"{c.hostnames[0]}:{port}", "--rdzv-id", str(port),
                     *command)
    env = netns.launch_env()
    start = time.monotonic()
    procs = [subprocess.Popen(_in_host(h, argv), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for h in c.hostnames]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    took = time.monotonic() - start
    if any(p.returncode for p in procs):
        raise RuntimeError("rendezvous launch failed: " + "\n".join(e[-1500:] for e in errors))
    return took


def _summary(times: list[float]) -> str:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (f"median {statistics.median(times):.3f} s, p95 {p95:.3f} s, "
            f"max {ordered[-1]:.3f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--name", default="rzbench", help="cluster name (at most 10 chars)")
    args = parser.parse_args()
    reason = netns.missing_requirements(probe=True)
    if reason:
        print(f"rendezvous_startup: {reason}", file=sys.stderr)
        return 2
    command = ["true"]
    plain: list[float] = []
    rdzv: list[float] = []
    with netns.Cluster(args.name, args.hosts, args.slots) as c:
        time_plain(c, args.slots, command)  # warm the page cache for both
        for index in range(args.rounds):
            plain.append(time_plain(c, args.slots, command))
            rdzv.append(time_rendezvous(c, args.slots, 29600 + index, command))
    load = os.getloadavg()[0]
    print(f"{args.hosts} hosts x {args.slots} ranks, '{shlex.join(command)}' on every rank, "
          f"{args.rounds} rounds, load average {load:.1f}")
    print(f"  mpirun:     {_summary(plain)}")
    print(f"  rendezvous: {_summary(rdzv)}")
    print(f"  the rendezvous adds {statistics.median(rdzv) - statistics.median(plain):.3f} s "
          f"(median), {statistics.median(rdzv) / statistics.median(plain):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
