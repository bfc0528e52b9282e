#!/usr/bin/env python3
"""Allreduce side by side: mpitrain's algorithms, MPI's own Allreduce and torch.distributed Gloo.

For each world size / topology (p=2, p=4 and the emulated 2x2 by default) one MPI job runs
every contender on the same float32 buffers, contenders taking turns round by round so that
drift on a shared machine hits them alike:

* ``mpitrain:<algo>`` (raw): ``mpitrain.ops.algorithms.allreduce`` with the algorithm forced
  (mpi, shm, ring, hierarchical) or ``auto``, on preallocated numpy buffers;
* ``api``: ``mpitrain.allreduce(torch_tensor, op=Sum)`` through the engine (a new output tensor
  each call, as users call it);
* ``mpi4py``: ``COMM_WORLD.Allreduce`` of the same MPI library;
* ``gloo``: ``torch.distributed.all_reduce`` with the Gloo backend.

Per size and contender it prints the median time after warm-up, algbw = S/t and busbw =
algbw·2(p-1)/p (nccl-tests), and ``floor`` = (2·p·S/t) / copy bandwidth, the fraction of the
memory-traffic limit reached (copy bandwidth is measured in the same job: all ranks copying a
buffer larger than the last-level cache at once, bytes read + written per second).  Then, per
topology, the measured crossover: the smallest size from which one of mpitrain's algorithms
beats MPI's Allreduce (the selection threshold in ``mpitrain.ops.algorithms``), and the same
for broadcast and allgather through shared memory against MPI's own (from 16 KiB).

    .venv/bin/python benchmarks/allreduce.py                      # 8 B .. 256 MiB, p=2,4,2x2
    .venv/bin/python benchmarks/allreduce.py --quick              # 8 B, 64 KiB, 1 MiB, 64 MiB
    .venv/bin/python benchmarks/allreduce.py --sizes 8 65536 67108864 --configs 2 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [8, 1 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB,
                 64 * MiB, 256 * MiB]
QUICK_SIZES = [8, 64 * KiB, 1 * MiB, 64 * MiB]
CONFIGS = {"2": (2, {}), "4": (4, {}), "2x2": (4, {"MPITRAIN_LOCAL_SIZE": "2"})}


def _iters(nbytes: int) -> int:
    if nbytes <= 64 * KiB:
        return 300
    if nbytes <= 4 * MiB:
        return 30
    return 9 if nbytes <= 64 * MiB else 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(sizes: list[int], rounds: int, streams: list[int], result: str) -> int:
    """Runs on every rank; rank 0 writes the medians as JSON to ``result``."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import mpitrain as hvd
    from mpitrain.core import config as config_mod
    from mpitrain.core import topology
    from mpitrain.core.dtypes import ReduceOp
    from mpitrain.ops import algorithms, mpi, shm
    from mpitrain.ops.group import Group
    from mpitrain.ops.reduction import Overrides, Reduction

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    hvd.init()
    cfg = config_mod.load()
    topo, comms = topology.build(world.Dup(), cfg.local_size)
    group = Group(comms, topo, cfg)
    sum32 = Reduction("float32", op=ReduceOp.SUM)  # the one reduction timed here
    port = world.bcast(_free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    # Copy bandwidth of the whole machine with every rank copying at once.
    big = np.ones(128 * MiB // 4, dtype=np.float32)
    dst = np.zeros_like(big)  # touched: we time copying, not page faults
    copy_rates = []
    for _ in range(5):
        world.Barrier()
        t0 = time.perf_counter()
        np.copyto(dst, big)
        local = time.perf_counter() - t0
        slowest = world.allreduce(local, op=MPI.MAX)
        copy_rates.append(2 * big.nbytes * size / slowest)
    copy_bw = statistics.median(copy_rates)
    del big, dst

    algos = ["mpi", "shm", "ring", "hierarchical", "auto"]
    if topo.num_nodes == 1:
        algos.remove("hierarchical")  # it is shm on one node
    results: dict[str, dict[int, list[float]]] = {}

    def timed(name: str, nbytes: int, fn, iters: int) -> None:
        fn()  # warm-up
        fn()
        times = []
        for _ in range(iters):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        results.setdefault(name, {}).setdefault(nbytes, []).extend(times)

    def measure(nbytes: int) -> None:
        n = max(1, nbytes // 4)
        src = np.full(n, rank + 1, dtype=np.float32)
        out = np.empty_like(src)
        tensor = torch.from_numpy(src.copy())
        iters = _iters(nbytes)
        contenders = {}
        for algo in algos:
            contenders[f"mpitrain:{algo}"] = (
                lambda a=algo: algorithms.allreduce(group, src, out, sum32,
                                                    overrides=Overrides(a, streams=1)))
        for s in streams:
            if s > 1 and nbytes >= 4 * MiB:
                contenders[f"mpitrain:auto,streams={s}"] = (
                    lambda s_=s: algorithms.allreduce(group, src, out, sum32,
                                                      overrides=Overrides(streams=s_)))
        contenders["api"] = lambda: hvd.allreduce(tensor, op=hvd.Sum, name="bench")
        contenders["mpi4py"] = lambda: world.Allreduce(src, out, op=MPI.SUM)
        contenders["gloo"] = lambda: dist.all_reduce(tensor)
        names = list(contenders)
        for r in range(rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                timed(name, nbytes, contenders[name], max(1, iters // rounds))
        # Correctness of what we time: the sum of 1..p on every element.
        algorithms.allreduce(group, src, out, sum32)
        assert float(out[0]) == size * (size + 1) / 2, out[0]

    for nbytes in sizes:
        measure(nbytes)

    # Broadcast and allgather: MPI's own against shared memory (algorithms.SHM_MIN_BYTES).
    node = group.node()
    one_node = topo.num_nodes == 1 and size > 1 and node.cma
    for nbytes in (s for s in sizes if s >= 16 * KiB and one_node):
        buf = np.full(nbytes, rank, dtype=np.uint8)
        part = np.full(nbytes // size, rank, dtype=np.uint8)
        gathered = np.empty(part.nbytes * size, dtype=np.uint8)
        counts = [part.nbytes] * size
        others = {
            "broadcast:mpi": lambda b=buf: mpi.broadcast(group, b, 0),
            "broadcast:shm": lambda b=buf: shm.broadcast(node, b, 0),
            "allgather:mpi": lambda p_=part, g=gathered, c=counts: mpi.allgather(group, p_, g, c),
            "allgather:shm": lambda p_=part, g=gathered, c=counts: shm.allgather(node, p_, g, c),
        }
        for _ in range(rounds):
            for name, fn in others.items():
                timed(name, nbytes, fn, max(1, _iters(nbytes) // rounds))
    dist.destroy_process_group()
    group.close()
    hvd.shutdown()
    if rank == 0:
        med = {name: {str(s): statistics.median(t) for s, t in per.items()}
               for name, per in results.items()}
        Path(result).write_text(json.dumps({"p": size, "nodes": topo.num_nodes,
                                            "copy_Bps": copy_bw, "median_s": med}))
    return 0


def _fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _fmt_time(t: float) -> str:
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"


def _from_on(wins: list[tuple[int, bool]]) -> int | None:
    """The smallest size from which the challenger wins at every larger size too."""
    start = None
    for size, won in sorted(wins):
        if not won:
            start = None
        elif start is None:
            start = size
    return start


def report(name: str, data: dict) -> str:
    p, copy_bw = data["p"], data["copy_Bps"]
    med = {k: v for k, v in data["median_s"].items() if ":" not in k or
           k.startswith("mpitrain:")}
    other = {k: v for k, v in data["median_s"].items() if k not in med}
    lines = [f"\n### p={p} ({name}; {data['nodes']} node(s)); copy bandwidth "
             f"{copy_bw / 1e9:.1f} GB/s (read+write, all ranks)",
             "",
             "| size | contender | median | algbw GB/s | busbw GB/s | floor | vs mpi4py |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    sizes = sorted({int(s) for per in med.values() for s in per})
    wins: list[tuple[int, bool]] = []
    for s in sizes:
        mpi_t = med["mpi4py"][str(s)]
        for contender in med:
            t = med[contender].get(str(s))
            if t is None:
                continue
            algbw = s / t
            busbw = algbw * 2 * (p - 1) / p
            floor = 2 * p * s / t / copy_bw
            lines.append(f"| {_fmt_size(s)} | {contender} | {_fmt_time(t)} | {algbw / 1e9:.2f} "
                         f"| {busbw / 1e9:.2f} | {floor:.0%} | {mpi_t / t:.2f}x |")
        fastest_own = min(med[c][str(s)] for c in med
                          if c.startswith("mpitrain:") and c != "mpitrain:mpi"
                          and "auto" not in c and str(s) in med[c])
        wins.append((s, fastest_own < med["mpitrain:mpi"][str(s)]))
    crossover = _from_on(wins)
    lines.append("")
    lines.append(f"measured crossover (p={p}, {name}): mpitrain's own algorithms beat MPI's "
                 + (f"Allreduce at every size from {_fmt_size(crossover)}" if crossover
                    else "Allreduce at no size up to the largest measured"))
    if other:
        lines += ["", "| size | broadcast mpi | broadcast shm | allgather mpi | allgather shm |",
                  "|---:|---:|---:|---:|---:|"]
        for s in sorted({int(s) for per in other.values() for s in per}):
            cells = [_fmt_time(other[k][str(s)]) for k in
                     ("broadcast:mpi", "broadcast:shm", "allgather:mpi", "allgather:shm")]
            lines.append(f"| {_fmt_size(s)} | " + " | ".join(cells) + " |")
        for kind in ("broadcast", "allgather"):
            shm_t, mpi_t = other[f"{kind}:shm"], other[f"{kind}:mpi"]
            start = _from_on(sorted((int(s), shm_t[s] < mpi_t[s]) for s in shm_t))
            tail = (f"beats MPI's at every size from {_fmt_size(start)}" if start
                    else "does not beat MPI's at the largest size measured")
            lines.append(f"\nmeasured crossover (p={p}, {name}): {kind} through shared memory "
                         f"{tail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", help="message sizes in bytes")
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="world sizes / topologies (2x2: 4 ranks as 2 emulated nodes)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds in which every contender takes its turn")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2],
                        help="MPITRAIN_ALLREDUCE_STREAMS values to compare (from 4 MiB)")
    parser.add_argument("--json", help="also write the raw medians here")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a --json file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.report:
        for name, data in json.loads(Path(args.report).read_text()).items():
            print(report(name, data))
        return 0
    if args.worker:
        return worker(sizes, args.rounds, args.streams, args.result)
    mpirun = Path(sys.executable).with_name("mpirun")
    everything = {}
    print(f"# allreduce float32, Sum; {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}")
    for name in args.configs:
        np_, extra = CONFIGS[name]
        env = dict(os.environ, **extra, OMPI_MCA_mpi_yield_when_idle="1",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   MPITRAIN_SET_CPU_THREADS="1", OMP_NUM_THREADS="1")
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            cmd = [str(mpirun), "--oversubscribe", "-np", str(np_), sys.executable, __file__,
                   "--worker", "--rounds", str(args.rounds), "--sizes", *map(str, sizes),
                   "--streams", *map(str, args.streams), "--result", str(result)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0 or not result.exists():
                print(f"config {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                      f"{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            data = json.loads(result.read_text())
        everything[name] = data
        print(report(name, data), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
