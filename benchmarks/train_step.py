#!/usr/bin/env python3
"""The training step users run, across namespace hosts: per-step times from the first step.

Builds a namespace cluster (tools/netns_cluster.py; 2 hosts x 2 ranks by default), shapes its
links (``--rate``, or ``--no-shape``), and runs one job across it.  In that job every
contender trains the same model (``--width``: 2 x Linear(W, W), 32 MiB of float32 gradients at
the default W=2048) from a fresh ``hvd.init()`` -- so auto's first calls, and any calibration,
are part of what is measured -- for ``--first`` steps, then ``--warmup`` more, then ``--steps``
timed ones.  A step is forward, backward, the reduction and the optimizer step; its time is the
slowest rank's.  Contenders take turns round by round.  Before the first, MPI's own Allreduce of
the gradients' bytes runs until its times settle (:func:`warm_the_link`): a fresh cluster's
links warm up once per job, not once per contender.

Contenders (``--contenders``):

* ``ideal``: the same step without a framework: forward and backward, then MPI's own
  Allreduce of the flat float32 gradient into a reused buffer, then SGD.  The floor a
  framework on MPI should reach.
* ``none``, ``fp16``, ``bf16``, ``powersgd``: mpitrain's ``DistributedOptimizer`` with that
  compression (PowerSGD rank 4, compressing from step 10).
* ``ddp``, ``ddp-fp16``: mpitrain's DDP drop-in, plain and with its fp16 compression hook.
* ``gloo``: torch's own DistributedDataParallel over Gloo (torch.distributed), the peer that
  ships with torch.
* ``horovod``: Horovod 0.28.1, when ``import horovod.torch`` finds a real Horovod (see
  benchmarks/horovod_peer.sh); skipped otherwise.

Run as root from a checkout with its .venv::

    .venv/bin/python benchmarks/train_step.py                        # 2 x 2 hosts, 1 Gbit/s
    .venv/bin/python benchmarks/train_step.py --rate 10gbit
    .venv/bin/python benchmarks/train_step.py --no-shape --hosts 3 --slots 2

The report gives, per contender, the step time p50/p95/max over the timed steps, its p50
against ``ideal`` and against ``none``, and the first steps' total against as many
steady-state steps (the calibration tax).  ``--json`` keeps every step's time.
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
ALL = ("ideal", "none", "fp16", "bf16", "powersgd", "ddp", "ddp-fp16", "gloo", "horovod")
DEFAULT = ("ideal", "none", "fp16", "bf16", "powersgd", "ddp", "ddp-fp16", "gloo")


def _model(width: int, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width))


def _batches(width: int, batch: int, rank: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(batch, width, generator=gen)
    return x, torch.randn(batch, width, generator=gen)


def _tcp_counters() -> tuple[int, int]:
    """This network namespace's TCP segments retransmitted and retransmission timeouts so
    far (/proc/net is per namespace, so each host's counts are its own)."""
    def table(path: str) -> dict[str, int]:
        rows = Path(path).read_text().splitlines()
        out = {}
        for head, values in zip(rows[::2], rows[1::2]):
            prefix = head.split(":")[0]
            for k, v in zip(head.split()[1:], values.split()[1:]):
                out[f"{prefix}.{k}"] = int(v)
        return out

    snmp, netstat = table("/proc/net/snmp"), table("/proc/net/netstat")
    return snmp.get("Tcp.RetransSegs", 0), netstat.get("TcpExt.TCPTimeouts", 0)


def _tcp_since(before: tuple[int, int], world) -> list[int]:
    """The whole cluster's retransmitted segments and timeouts since ``before``, counted once
    per host (by its first local rank)."""
    first_on_host = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") == "0"
    now = _tcp_counters()
    mine = [a - b for a, b in zip(now, before)] if first_on_host else [0, 0]
    return [sum(c) for c in zip(*world.allgather(mine))]


def _step_loop(step, count: int, world) -> list[float]:
    """Time ``count`` calls of ``step``; each time is the slowest rank's (gathered after the
    loop, so no extra collective runs between steps)."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return [max(t) for t in zip(*world.allgather(times))]


def _gloo_group(world):
    """torch.distributed over Gloo across the namespace hosts (rank 0's address by MPI)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    address = world.bcast(socket.gethostbyname(socket.gethostname()) if world.rank == 0
                          else None, root=0)
    port = world.bcast(29500 + os.getpid() % 1000 if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}",
                            rank=world.rank, world_size=world.size)


def run_contender(name: str, args: argparse.Namespace, world) -> dict[str, list[float]]:
    """Train ``name`` from a fresh start; return its first and timed steps' times."""
    import numpy as np
    import torch

    import mpitrain as hvd

    torch.set_num_threads(1)
    model = _model(args.width)
    x, y = _batches(args.width, args.batch, world.rank)
    loss_fn = torch.nn.functional.mse_loss
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = None
    cleanup = []

    if name == "ideal":
        params = list(model.parameters())
        flat = np.zeros(sum(p.numel() for p in params), dtype=np.float32)
        out = np.empty_like(flat)
        from mpi4py import MPI

        def step():
            sgd.zero_grad()
            loss_fn(model(x), y).backward()
            offset = 0
            for p in params:
                n = p.numel()
                flat[offset:offset + n] = p.grad.numpy().ravel()
                offset += n
            world.Allreduce(flat, out, op=MPI.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(torch.from_numpy(out[offset:offset + n]).view_as(p)) \
                    .div_(world.size)
                offset += n
            sgd.step()
    elif name in ("none", "fp16", "bf16", "powersgd"):
        hvd.init()
        cleanup.append(hvd.shutdown)
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                       "bf16": hvd.Compression.bf16}.get(name) or \
            hvd.Compression.powersgd(rank=4, start_iter=10)
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=compression)

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    elif name in ("ddp", "ddp-fp16"):
        hvd.init()
        cleanup.append(hvd.shutdown)
        from mpitrain.torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if name == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)

        def step():
            sgd.zero_grad()
            loss_fn(ddp(x), y).backward()
            sgd.step()
    elif name == "gloo":
        import torch.distributed as dist

        _gloo_group(world)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        cleanup.append(dist.barrier)

        def step():
            sgd.zero_grad()
            loss_fn(ddp(x), y).backward()
            sgd.step()
    elif name == "horovod":
        import horovod.torch as horovod

        horovod.init()
        cleanup.append(horovod.shutdown)
        opt = horovod.DistributedOptimizer(sgd, named_parameters=model.named_parameters())

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    else:
        raise ValueError(f"unknown contender {name!r}; choose from {', '.join(ALL)}")

    world.Barrier()
    tcp = _tcp_counters()
    first = _step_loop(step, args.first, world)
    tcp_first = _tcp_since(tcp, world)
    _step_loop(step, args.warmup, world)
    tcp = _tcp_counters()
    timed = _step_loop(step, args.steps, world)
    tcp_timed = _tcp_since(tcp, world)
    for done in cleanup:
        done()
    return {"first": first, "timed": timed, "tcp_first": tcp_first, "tcp_timed": tcp_timed}


def warm_the_link(world, nbytes: int, most: int = 40) -> tuple[int, float]:
    """MPI's own Allreduce of ``nbytes`` until five calls in a row are within 1.25x of the
    fastest so far (at most ``most`` calls); returns (calls, seconds).

    A fresh job's first calls across a shaped namespace link are erratic: 32 MiB at 1 Gbit/s
    took 0.29-3.5 s over its first ten calls, then 0.28-0.31 s, the same for MPI's own and
    mpitrain (2026-11-29).  That is the link's and TCP's warm-up, paid once per job by
    whichever contender ran first; paid here instead, before any of them.
    """
    import numpy as np
    from mpi4py import MPI

    send = np.ones(nbytes // 4, dtype=np.float32)
    recv = np.empty_like(send)
    start, fastest, steady, calls = time.perf_counter(), float("inf"), 0, 0
    while steady < 5 and calls < most:
        begin = time.perf_counter()
        world.Allreduce(send, recv, op=MPI.SUM)
        took = world.allreduce(time.perf_counter() - begin, op=MPI.MAX)
        calls += 1
        fastest = min(fastest, took)
        steady = steady + 1 if took <= 1.25 * fastest else 0
    return calls, time.perf_counter() - start


def worker(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    # mpitrain's init() has glibc keep freed memory (mpitrain.core.host_malloc), process-wide,
    # so it would hold for every contender after the first mpitrain one anyway: set it (or,
    # with --malloc-default, glibc's default) for all of them from the start, alike.
    from mpitrain.core import host_malloc

    kept = False if args.malloc_default else host_malloc.keep_freed_memory(1 << 30)
    warm = warm_the_link(world, 2 * args.width ** 2 * 4)
    names = list(args.contenders)
    if "horovod" in names:
        try:
            import horovod.torch  # noqa: F401 - only to see whether a real Horovod is here
        except ImportError:
            names.remove("horovod")
    results: dict[str, list[dict[str, list[float]]]] = {}
    for round_ in range(args.rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            results.setdefault(name, []).append(run_contender(name, args, world))
    if world.rank == 0:
        load = os.getloadavg()
        print("BENCH " + json.dumps({"size": world.size, "width": args.width,
                                     "batch": args.batch, "load": load, "warm": warm,
                                     "malloc_kept": kept,
                                     "results": results}), flush=True)
    return 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def report(data: dict, shaped: dict[str, str], hosts: int) -> str:
    p = data["size"]
    lines = [f"training step across {hosts} namespace hosts x {p // hosts} ranks, "
             f"2 x Linear({data['width']}, {data['width']}) "
             f"({2 * data['width'] ** 2 * 4 / 2**20:.0f} MiB of float32 gradients), batch "
             f"{data['batch']} per rank; link: "
             + (", ".join(f"{k} {v}" for k, v in shaped.items()) or "unshaped")
             + f"; load average at the end {data['load'][0]:.1f}"
             + (f"; link warmed first by {data['warm'][0]} calls of MPI's Allreduce in "
                f"{data['warm'][1]:.1f} s" if "warm" in data else "")
             + ("; every contender with glibc keeping freed memory (as mpitrain's init sets)"
                if data.get("malloc_kept") else "; glibc malloc's defaults"),
             f"{'contender':>10} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'p95/p50':>8} "
             f"{'max/p50':>8} {'vs ideal':>9} {'vs none':>8} {'first/steady':>13} "
             f"{'retrans/step':>13} {'RTOs':>5}"]
    stats = {}
    for name, rounds in data["results"].items():
        timed = [t for r in rounds for t in r["timed"]]
        first = [sum(r["first"]) for r in rounds]
        p50 = statistics.median(timed)
        # TCP's retransmissions and timeouts during the timed steps, all rounds (older
        # results have none): a retransmission timeout stalls a flow for >= 200 ms.
        tcp = [sum(r.get("tcp_timed", [0, 0])[i] for r in rounds) for i in (0, 1)]
        stats[name] = (p50, _pct(timed, 0.95), max(timed),
                       statistics.median(first) / (p50 * len(rounds[0]["first"])),
                       tcp[0] / max(1, len(timed)), tcp[1])
    for name, (p50, p95, worst, tax, retrans, rtos) in stats.items():
        ideal = stats.get("ideal", (None,))[0]
        none = stats.get("none", (None,))[0]
        lines.append(f"{name:>10} {p50 * 1e3:>8.1f} {p95 * 1e3:>8.1f} {worst * 1e3:>8.1f} "
                     f"{p95 / p50:>8.2f} {worst / p50:>8.2f} "
                     f"{(p50 / ideal if ideal else float('nan')):>8.2f}x "
                     f"{(p50 / none if none else float('nan')):>7.2f}x {tax:>12.2f}x "
                     f"{retrans:>13.1f} {rtos:>5d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Needs root, ip, tc and unshare.")
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts (default 2)")
    parser.add_argument("--slots", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--width", type=int, default=2048, help="layer width (default 2048)")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    parser.add_argument("--first", type=int, default=20, help="first steps, timed apart")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps after those")
    parser.add_argument("--steps", type=int, default=50, help="timed steady-state steps")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all contenders")
    parser.add_argument("--contenders", nargs="+", default=list(DEFAULT), choices=ALL,
                        help=f"default: {' '.join(DEFAULT)}")
    parser.add_argument("--rate", default="1gbit", help="tbf rate per host link")
    parser.add_argument("--burst", default="128kb", help="tbf bucket")
    parser.add_argument("--latency", default="10ms", help="tbf queueing bound")
    parser.add_argument("--no-shape", action="store_true", help="leave the links unshaped")
    parser.add_argument("--malloc-default", action="store_true",
                        help="leave glibc's malloc as it is for every contender (mpitrain's "
                        "init() otherwise keeps freed memory: MPITRAIN_MALLOC_TRIM_THRESHOLD)")
    parser.add_argument("--name", default="mtstep", help="cluster name")
    parser.add_argument("--json", help="also write every step's time here")
    parser.add_argument("--log", help="also write the job's stderr here (with "
                        "MPITRAIN_LOG_LEVEL=INFO: auto's calibration decisions)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(ROOT / "tools"))
    from netns_cluster import Cluster, launch_env, missing_requirements

    reason = missing_requirements()
    if reason:
        print(f"train_step: cannot build the cluster: {reason}", file=sys.stderr)
        return 2
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:])
                 if a not in ("--no-shape",)]
    with Cluster(args.name, args.hosts, args.slots) as cluster:
        if not args.no_shape:
            cluster.shape(args.rate, args.burst, args.latency)
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", *forwarded]
        env = launch_env()
        if args.malloc_default:
            env["MPITRAIN_MALLOC_TRIM_THRESHOLD"] = "0"
        result = subprocess.run(cluster.launch_argv(args.hosts * args.slots, command),
                                env=env, capture_output=True, text=True, timeout=7200)
        shaped = dict(cluster.shaped)
    if args.log:
        Path(args.log).write_text(result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
        return result.returncode or 1
    data = json.loads(lines[-1][len("BENCH "):])
    if args.json:
        Path(args.json).write_text(json.dumps({"shaping": shaped, **data}, indent=1))
    print(report(data, shaped, args.hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
