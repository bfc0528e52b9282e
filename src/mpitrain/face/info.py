"""``python -m mpitrain.face.info``: what this job looks like from inside.

Run it under your launcher exactly as you would run training::

    mpirun -np 4 python -m mpitrain.face.info
    MPITRAIN_LOCAL_SIZE=2 mpirun -np 4 python -m mpitrain.face.info   # 2 emulated nodes x 2

Rank 0 prints one line per rank (host, local and cross layout, device binding, threads), the
MPI library and thread level, what the install supports, and a smoke allreduce; every rank
takes part.  ``--json`` prints the same as JSON; ``--env`` lists every MPITRAIN_* variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .. import session
from ..core import _mpi, config, runtime
from ..core.dtypes import ReduceOp
from ..core.version import __version__


def _versions() -> dict[str, str]:
    found = {"mpitrain": __version__}
    for name in ("mpi4py", "numpy", "numba", "torch", "cupy"):
        try:
            module = __import__(name)
            found[name] = str(getattr(module, "__version__", "?"))
        except Exception:  # noqa: BLE001 - absent or broken: report, do not fail
            found[name] = "not installed"
    return found


def _rank_row() -> dict[str, Any]:
    state = runtime.state()
    topo = state.topology
    return {
        "rank": topo.rank,
        "host": topo.hostname,
        "local_rank": topo.local_rank,
        "local_size": topo.local_size,
        "cross_rank": topo.cross_rank,
        "cross_size": topo.cross_size,
        "node": topo.node_index,
        "device": f"cuda:{state.device}" if state.device is not None else "cpu",
        "cpu_threads": state.cpu_threads,
    }


def collect() -> dict[str, Any]:
    """Gather the job's layout to every rank (collective: every rank must call it)."""
    from .. import allreduce  # the hvd face (torch) loads on first use

    state = runtime.state()
    rows = state.comms.world.allgather(_rank_row())
    total = allreduce(np.array([float(runtime.rank() + 1)]), op=ReduceOp.SUM)
    size = runtime.size()
    MPI = _mpi.load()
    return {
        "size": size,
        "nodes": state.topology.num_nodes,
        "homogeneous": state.topology.is_homogeneous,
        "emulated_nodes": state.topology.emulated,
        "mpi_library": _mpi.library_version(),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "thread_level": _mpi.thread_level_name(state.thread_level),
        "cuda": runtime.cuda_built(),
        "versions": _versions(),
        "allreduce_check": {"got": float(total[0]), "expected": size * (size + 1) / 2},
        "ranks": rows,
    }


def _print_table(info: dict[str, Any]) -> None:
    head = ("rank", "host", "local", "cross", "node", "device", "threads")
    lines = [head]
    for r in info["ranks"]:
        lines.append((str(r["rank"]), r["host"], f"{r['local_rank']}/{r['local_size']}",
                      f"{r['cross_rank']}/{r['cross_size']}", str(r["node"]), r["device"],
                      str(r["cpu_threads"] if r["cpu_threads"] is not None else "user")))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    print(f"mpitrain {info['versions']['mpitrain']}: {info['size']} ranks on {info['nodes']} "
          f"node(s){' (emulated)' if info['emulated_nodes'] else ''}, "
          f"{'homogeneous' if info['homogeneous'] else 'heterogeneous'}")
    print(f"MPI: {info['mpi_library']} (standard {info['mpi_standard']}, "
          f"{info['thread_level']})")
    print("CUDA data plane: " + ("available" if info["cuda"] else "not available (CPU only)"))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    for row in lines:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    check = info["allreduce_check"]
    status = "ok" if check["got"] == check["expected"] else "WRONG"
    print(f"allreduce check: sum of (rank+1) = {check['got']:g}, expected "
          f"{check['expected']:g}: {status}")


def _print_env() -> None:
    for name, default, help_text in config.describe():
        print(f"{name} (default {default})\n    {help_text}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mpitrain-info",
        description="Show how mpitrain sees this job: ranks, hosts, local/cross layout, device "
                    "binding, MPI library and thread level.  Run it under mpirun like training.")
    parser.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--env", action="store_true",
                        help="list every MPITRAIN_* variable with its default, then exit")
    args = parser.parse_args(argv)
    if args.env:
        _print_env()
        return 0
    session.init()
    info = collect()
    if runtime.rank() == 0:
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_table(info)
        sys.stdout.flush()
    ok = info["allreduce_check"]["got"] == info["allreduce_check"]["expected"]
    session.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
