#!/usr/bin/env python3
"""What MPITRAIN_DETERMINISTIC costs: its two designs beside the default mode and MPI's own.

For each world size / topology (p=2, p=4, and the emulated 2x2 with ``--configs 2x2``) one
MPI job runs every contender on the same float32 buffers (an Average, as gradients are
averaged), taking turns round by round so that drift on a shared machine hits them alike:

* ``mpi4py``: ``Allreduce`` (Sum) of the same MPI library, called directly;
* ``default``: ``mpitrain.ops.algorithms.allreduce`` as the engine calls it, ``auto``;
* ``rank-order`` and ``fixed-point``: the same call with MPITRAIN_DETERMINISTIC set so.

Each contender has its own duplicated communicators and its own configuration.  Printed per
size: median and p95 time over every round's iterations (the slowest rank's), the ratio of
the median to the default mode's, and the payload: bytes per rank handed to the collectives
the design runs, as a multiple of the buffer (the default mode moves the buffer itself; the
fixed-point sum one exponent byte and one 8-byte integer per element).  The load average is
printed with the table: on a shared machine only ratios measured in one run mean anything.

    .venv/bin/python benchmarks/deterministic.py                         # 64 KiB, 4 MiB, 64 MiB
    .venv/bin/python benchmarks/deterministic.py --configs 2 4 2x2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [64 * KiB, 4 * MiB, 64 * MiB]
CONFIGS = {"2": (2, {}), "4": (4, {}), "2x2": (4, {"MPITRAIN_LOCAL_SIZE": "2"})}
CONTENDERS = ("mpi4py", "default", "rank-order", "fixed-point")
# Calls before timing: across nodes auto calibrates on the first allreduces of each size (at
# most calibration.TRIALS calls of three contenders, then of two again: 15); steady state after.
WARMUP = 16
# Bytes handed to collectives per byte of a float32 buffer.
PAYLOAD = {"mpi4py": 1.0, "default": 1.0, "rank-order": 1.0, "fixed-point": (1 + 8) / 4}


def _iters(nbytes: int) -> int:
    if nbytes <= 64 * KiB:
        return 100
    return 10 if nbytes <= 4 * MiB else 3


def worker(sizes: list[int], rounds: int, result: str) -> int:
    """Runs on every rank; rank 0 writes every contender's times as JSON to ``result``."""
    import numpy as np
    from mpi4py import MPI

    from mpitrain.core import config as config_mod
    from mpitrain.core import topology
    from mpitrain.core.dtypes import ReduceOp
    from mpitrain.ops import algorithms
    from mpitrain.ops.group import Group
    from mpitrain.ops.reduction import Reduction

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    base = config_mod.load()
    groups = {}
    for name in CONTENDERS[1:]:
        cfg = config_mod.load(deterministic="" if name == "default" else name)
        topo, comms = topology.build(world.Dup(), base.local_size)
        groups[name] = Group(comms, topo, cfg)
    direct = world.Dup()
    times: dict[str, dict[int, list[float]]] = {c: {} for c in CONTENDERS}
    rng = np.random.default_rng(rank)

    def call(name: str, src: np.ndarray, out: np.ndarray) -> None:
        if name == "mpi4py":
            direct.Allreduce(src, out, op=MPI.SUM)
        else:
            algorithms.allreduce(groups[name], src, out,
                                 Reduction("float32", 1.0, 1.0 / size, ReduceOp.SUM))

    for nbytes in sizes:
        src = rng.normal(size=nbytes // 4).astype(np.float32)
        out = np.empty_like(src)
        for name in CONTENDERS:  # warm-up: kernels compiled, buffers and windows grown, and
            for _ in range(WARMUP):  # across nodes auto's calibration done
                call(name, src, out)
        for _ in range(rounds):
            for name in CONTENDERS:
                for _ in range(_iters(nbytes)):
                    world.Barrier()
                    t0 = time.perf_counter()
                    call(name, src, out)
                    elapsed = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                    times[name].setdefault(nbytes, []).append(elapsed)
    for g in groups.values():
        g.close()
    direct.Free()
    if rank == 0:
        Path(result).write_text(json.dumps({"size": size, "times": times}))
    return 0


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def report(name: str, data: dict, load: str) -> str:
    times = {c: {int(k): v for k, v in d.items()} for c, d in data["times"].items()}
    lines = [f"\n## {name} ({data['size']} ranks; load average before/after: {load})", "",
             "| size | contender | median | p95 | x default | payload |",
             "| --- | --- | --- | --- | --- | --- |"]
    for nbytes in sorted(times["default"]):
        base = statistics.median(times["default"][nbytes])
        for c in CONTENDERS:
            t = sorted(times[c][nbytes])
            med = statistics.median(t)
            p95 = t[min(len(t) - 1, int(0.95 * len(t)))]
            lines.append(f"| {_fmt_size(nbytes)} | {c} | {med * 1e3:.2f} ms | {p95 * 1e3:.2f} ms "
                         f"| {med / base:.2f} | {PAYLOAD[c]:.2f} x |")
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES,
                        help="buffer sizes in bytes")
    parser.add_argument("--configs", nargs="+", default=["2", "4"], choices=list(CONFIGS),
                        help="world sizes / topologies (2x2: 4 ranks as 2 emulated nodes)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds in which every contender takes its turn")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for nbytes in args.sizes:
        if nbytes < 4 or nbytes % 4:
            parser.error(f"--sizes: {nbytes} is not a positive multiple of 4 bytes (float32)")
    if args.worker:
        return worker(args.sizes, args.rounds, args.result)
    mpirun = Path(sys.executable).with_name("mpirun")
    print(f"# float32 Average, MPITRAIN_DETERMINISTIC's designs beside the default; "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}")
    for name in args.configs:
        np_, extra = CONFIGS[name]
        env = dict(os.environ, **extra, OMPI_MCA_mpi_yield_when_idle="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMP_NUM_THREADS="1")
        env.pop("MPITRAIN_DETERMINISTIC", None)  # each contender sets its own
        before = _load()
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [str(mpirun), "--oversubscribe", "-np", str(np_), sys.executable, __file__,
                   "--worker", "--rounds", str(args.rounds), "--sizes", *map(str, args.sizes),
                   "--result", str(result)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0 or not result.exists():
                print(f"config {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                      f"{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            data = json.loads(result.read_text())
        print(report(name, data, f"{before} / {_load()}"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
