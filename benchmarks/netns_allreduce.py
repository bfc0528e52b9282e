#!/usr/bin/env python3
"""Flat ring vs hierarchical vs auto allreduce across shaped links, measured in one run.

Builds a namespace cluster (tools/netns_cluster.py: 2 hosts x 2 ranks by default), shapes
every host's link with ``tc tbf`` (1 Gbit/s by default), and runs ONE job across it.  In that
job each round re-initialises mpitrain once per contender (``MPITRAIN_ALLREDUCE_ALGORITHM`` is
read at ``init()``) and times the same allreduces; contenders take turns round by round, so
drift on this shared machine hits them alike.  MPI's own ``Allreduce`` (mpi4py on
COMM_WORLD) is the peer.  Also measured in the same job: the shaped link itself (rank 0 on one
host sends to rank ``local_size`` on the next).

Run as root from a checkout with its .venv::

    .venv/bin/python benchmarks/netns_allreduce.py                 # 1gbit, 4 and 32 MiB
    .venv/bin/python benchmarks/netns_allreduce.py --rate 10gbit --sizes-mib 1 16 64
    .venv/bin/python benchmarks/netns_allreduce.py --no-shape --hosts 2 --slots 2

``engine-mpi`` is MPI's own Allreduce run by mpitrain's engine
(``MPITRAIN_ALLREDUCE_ALGORITHM=mpi``): its distance from ``mpi`` is the engine's per-call
cost (negotiation, two thread hand-offs), which every mpitrain contender pays and which
decides at 1 MiB; ``auto`` against it says whether auto's choice of algorithm was right.

``--pipeline K`` adds ``hierarchical-pipelined``: the hierarchical allreduce with its steps
overlapped over K chunks (``MPITRAIN_HIERARCHICAL_PIPELINE=K``).

mpitrain is timed in place (``hvd.allreduce_``, how ``DistributedOptimizer`` reduces
gradients) and MPI's ``Allreduce`` into a buffer it reuses: an out-of-place ``hvd.allreduce``
returns a new tensor each call, and writing a fresh 1 MiB costs page faults that are not the
allreduce's (2 ranks on one machine, 2026-11-27: 1 MiB in place ~0.24 ms, out of place ~0.5 ms,
MPI into a fresh ``np.empty`` each call 0.6 ms).

``--fp16`` adds each contender on float16 tensors of the same element count (half the bytes),
as ``Compression.fp16`` sends gradients; their "vs MPI" compares with MPI's float32 Allreduce
of the same elements, what a user who turns compression on gains.

Output: per size, the median over every timed call (each call's time is its slowest rank's)
of each contender, its algbw and busbw (nccl-tests: algbw
= S/t, busbw = algbw * 2(p-1)/p) and its time relative to MPI's; then, per size, which of ring
and hierarchical was faster and how close ``auto`` came to it (``auto`` leaves messages below
its measured crossover to MPI's own allreduce, and from there, across nodes, times MPI's own,
hierarchical and ring on its first calls of each size and keeps the fastest; the benchmark
warms ``auto`` up past those trials; see ``mpitrain.ops.calibration``).
``tbf`` limits rate; ``netem`` (added delay) is not available on our machines, so the latency
argument is tbf's queueing bound, not a fixed delay.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("ring", "hierarchical", "auto")
# hvd.allreduce(float32, compression=Compression.fp16): the functional call, under auto.
FUNCTIONAL_FP16 = "auto-functional-fp16"
MiB = 1 << 20


def _timed(fn, iters: int, barrier) -> list[float]:
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _call(hvd, name: str, wide, half):
    """One timed call of contender ``name``: the in-place allreduce of the float32 buffer
    (or of its float16 copy for ``-fp16``), or, for ``FUNCTIONAL_FP16``, the call users write
    to compress: ``hvd.allreduce(float32 tensor, compression=Compression.fp16)``, which casts
    into a new tensor and returns a new float32 one."""
    if name == FUNCTIONAL_FP16:
        return lambda: hvd.allreduce(wide, op=hvd.Sum, compression=hvd.Compression.fp16)
    buf = half if name.endswith("-fp16") else wide
    return lambda: hvd.allreduce_(buf, op=hvd.Sum, name=f"bench.{buf.numel()}")


def worker(sizes_mib: list[float], rounds: int, iters: int, fp16: bool,
           pipeline: int = 0) -> int:
    """Runs on every rank: the measurement itself; rank 0 prints one JSON line."""
    import numpy as np
    import torch
    from mpi4py import MPI

    import mpitrain as hvd
    from mpitrain.ops.calibration import calls_to_decide

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    results: dict[str, dict[str, list[float]]] = {}
    # mpitrain reduces in place (hvd.allreduce_, as DistributedOptimizer reduces gradients)
    # and MPI into a reused buffer, so neither pays for a fresh output each call (its first
    # touch: page faults, ~0.2 ms per MiB here).  Zeros, so repeated sums stay finite.
    buffers = {s: torch.zeros(int(s * MiB) // 4, dtype=torch.float32) for s in sizes_mib}
    halves = {s: b.to(torch.float16) for s, b in buffers.items()}
    contenders = [*CONTENDERS, "engine-mpi",
                  *(["hierarchical-pipelined"] if pipeline > 1 else []),
                  *(f"{c}-fp16" for c in CONTENDERS if fp16),
                  *([FUNCTIONAL_FP16] if fp16 else [])]

    def record(name: str, s: float, times: list[float]) -> None:
        # A collective ends at its slowest rank: each call's time is its slowest rank's.
        slowest = np.empty(len(times))
        world.Allreduce(np.array(times), slowest, op=MPI.MAX)
        results.setdefault(name, {}).setdefault(str(s), []).extend(slowest.tolist())

    link = None
    hvd.init()
    local = hvd.local_size()
    hvd.shutdown()
    if size > local:  # one rank on each of two hosts: the shaped link alone
        nbytes = int(max(sizes_mib) * MiB)
        payload = np.ones(nbytes, dtype=np.uint8)
        if rank in (0, local):
            peer = local if rank == 0 else 0
            world.Sendrecv(payload[:1024], peer, recvbuf=payload[:1024], source=peer)
            start = time.perf_counter()
            if rank == 0:
                world.Send(payload, dest=peer)
                world.Recv(payload[:1], source=peer)
            else:
                world.Recv(payload, source=peer)
                world.Send(payload[:1], dest=peer)
            link = nbytes / (time.perf_counter() - start)
        link = world.bcast(link, root=0)

    for round_ in range(rounds):
        for s, buf in buffers.items():
            out = np.empty_like(buf.numpy())
            world.Allreduce(buf.numpy(), out)  # warm-up
            record("mpi", s, _timed(lambda b=buf, o=out: world.Allreduce(b.numpy(), o), iters,
                                    world.Barrier))
        # Rotate who goes first each round so that order effects fall on everyone alike.
        turn = round_ % len(contenders)
        for name in contenders[turn:] + contenders[:turn]:
            algorithm = name.removesuffix("-fp16").removesuffix("-functional")
            if algorithm == "engine-mpi":
                algorithm = "mpi"
            if algorithm == "hierarchical-pipelined":
                algorithm = "hierarchical"
                os.environ["MPITRAIN_HIERARCHICAL_PIPELINE"] = str(pipeline)
            else:
                os.environ.pop("MPITRAIN_HIERARCHICAL_PIPELINE", None)
            os.environ["MPITRAIN_ALLREDUCE_ALGORITHM"] = algorithm
            # auto says what its trials chose (rank 0, stderr): the report lists it.
            os.environ["MPITRAIN_LOG_LEVEL"] = "INFO" if algorithm == "auto" else "WARNING"
            hvd.init()
            for s in buffers:
                call = _call(hvd, name, buffers[s], halves[s])
                # auto first times each contender on its first calls of a size (across
                # nodes, mpitrain.ops.calibration): warm up past that, as training does.
                for _ in range(1 + calls_to_decide(3) if name.startswith("auto") else 1):
                    call()
                # Aligned by MPI's own barrier, as MPI's calls are: the same start for all
                # (hvd.barrier's exit is staggered by its round, which would count here).
                record(name, s, _timed(call, iters, world.Barrier))
            hvd.shutdown()
    if rank == 0:
        print("BENCH " + json.dumps({"size": size, "local_size": local, "link_Bps": link,
                                     "contenders": contenders, "results": results}), flush=True)
    return 0


def report(data: dict, shaped: dict[str, str]) -> str:
    p = data["size"]
    lines = [f"allreduce of float32 across {p // data['local_size']} namespace hosts x "
             f"{data['local_size']} ranks; link shaping: "
             + (", ".join(f"{k} {v}" for k, v in shaped.items()) or "none")]
    if data["link_Bps"]:
        lines.append(f"measured host-to-host link: {data['link_Bps'] / 1e6:.0f} MB/s")
    results = data["results"]
    names = ["mpi", *data.get("contenders", CONTENDERS)]
    lines.append(f"{'size':>9} {'contender':>13} {'median ms':>10} {'algbw GB/s':>11} "
                 f"{'busbw GB/s':>11} {'vs MPI':>7}")
    verdicts = []
    for s in results["mpi"]:
        nbytes = float(s) * MiB
        medians = {n: statistics.median(results[n][s]) for n in names}
        for n in names:
            # algbw in the float32 bytes the user reduces, so fp16 rows show the gain.
            algbw = nbytes / medians[n] / 1e9
            lines.append(f"{float(s):>6g}MiB {n:>13} {medians[n] * 1e3:>10.3f} {algbw:>11.3f} "
                         f"{algbw * 2 * (p - 1) / p:>11.3f} "
                         f"{medians['mpi'] / medians[n]:>6.2f}x")
        best = min(("ring", "hierarchical"), key=lambda n: medians[n])
        other = "hierarchical" if best == "ring" else "ring"
        verdicts.append(f"{float(s):g} MiB: {best} is {medians[other] / medians[best]:.2f}x "
                        f"faster than {other}; auto takes {medians['auto'] / medians[best]:.2f}x "
                        f"the time of {best}")
        if "engine-mpi" in medians:
            verdicts.append(f"{float(s):g} MiB: MPI's own through the engine takes "
                            f"{medians['engine-mpi'] / medians['mpi']:.2f}x the time of MPI's "
                            f"own called directly; auto takes "
                            f"{medians['auto'] / medians['engine-mpi']:.2f}x the time of the "
                            f"former")
        if FUNCTIONAL_FP16 in medians:
            verdicts.append(f"{float(s):g} MiB: hvd.allreduce(float32, compression=fp16) is "
                            f"{medians['mpi'] / medians[FUNCTIONAL_FP16]:.2f}x MPI's float32 "
                            f"and {medians['auto-fp16'] / medians[FUNCTIONAL_FP16]:.2f}x auto "
                            f"on a float16 buffer in place")
        if "auto-fp16" in medians:
            verdicts.append(f"{float(s):g} MiB: auto on float16 is "
                            f"{medians['mpi'] / medians['auto-fp16']:.2f}x MPI's float32 and "
                            f"{medians['auto'] / medians['auto-fp16']:.2f}x auto on float32")
    decisions = data.get("auto_decisions", [])
    if decisions:
        verdicts += ["", "auto's choices (one line per round and size class; sizes are the "
                     "bytes MPI's own would move, 16-bit classes apart):", *decisions]
    return "\n".join(lines + ["", *verdicts])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Needs root, ip, tc and unshare.")
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts (default 2)")
    parser.add_argument("--slots", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[4.0, 32.0],
                        help="message sizes in MiB (default 4 32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of all contenders")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per round")
    parser.add_argument("--rate", default="1gbit", help="tbf rate per host link")
    parser.add_argument("--burst", default="128kb", help="tbf bucket")
    parser.add_argument("--latency", default="10ms", help="tbf queueing bound")
    parser.add_argument("--no-shape", action="store_true", help="leave the links unshaped")
    parser.add_argument("--name", default="mtbench", help="cluster name")
    parser.add_argument("--json", help="also write the raw measurements here")
    parser.add_argument("--fp16", action="store_true",
                        help="also every contender on float16 tensors of the same length, and "
                             "hvd.allreduce(float32, compression=Compression.fp16)")
    parser.add_argument("--pipeline", type=int, default=0, metavar="K",
                        help="also time the hierarchical allreduce pipelined over K chunks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.sizes_mib, args.rounds, args.iters, args.fp16, args.pipeline)

    sys.path.insert(0, str(ROOT / "tools"))
    from netns_cluster import Cluster, launch_env, missing_requirements

    reason = missing_requirements()
    if reason:
        print(f"netns_allreduce: cannot build the cluster: {reason}", file=sys.stderr)
        return 2
    with Cluster(args.name, args.hosts, args.slots) as cluster:
        if not args.no_shape:
            cluster.shape(args.rate, args.burst, args.latency)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--rounds",
                   str(args.rounds), "--iters", str(args.iters), "--sizes-mib",
                   *map(str, args.sizes_mib), *(["--fp16"] if args.fp16 else []),
                   "--pipeline", str(args.pipeline)]
        result = subprocess.run(cluster.launch_argv(args.hosts * args.slots, command),
                                env=launch_env(), capture_output=True, text=True, timeout=3600)
        shaped = dict(cluster.shaped)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
        return result.returncode or 1
    data = json.loads(lines[-1][len("BENCH "):])
    data["auto_decisions"] = [line.split("auto across nodes: ", 1)[1]
                              for line in result.stderr.splitlines()
                              if "auto across nodes: " in line]
    if args.json:
        Path(args.json).write_text(json.dumps({"shaping": shaped, **data}, indent=1))
    print(report(data, shaped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
