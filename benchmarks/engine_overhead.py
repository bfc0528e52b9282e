"""Per-operation overhead of mpitrain's engine next to mpi4py's own Allreduce.

Run under mpirun, e.g.::

    mpirun -np 2 python benchmarks/engine_overhead.py
    mpirun -np 4 --oversubscribe python benchmarks/engine_overhead.py --ops 1000

Three patterns, each on tiny tensors (4 float32) so that only overhead is measured:

* async:   N allreduce_async submitted back to back, then all synchronized (a backward pass);
* sync:    N allreduce calls one at a time (each waits for the previous);
* grouped: N tensors as grouped_allreduce calls of 100 tensors each;

and mpi4py's ``comm.Allreduce`` on the same tiny buffer, N times.  When ``horovod.torch``
imports (an environment built by ``benchmarks/horovod_peer.sh``), Horovod's engine runs the
same three patterns in the same job, as the live peer.  The engines take turns, round after
round (``--rounds``): each is measured while the other is shut down, as a user runs one of
them, not both (Horovod's idle background thread polls MPI every cycle and takes a core from
whichever engine is being measured; ours sleeps).  Medians over the rounds of the mean of
``--repeats`` (the mean, so that a pause of Python's cyclic collector counts: 112 ms with
torch imported, unless mpitrain's init() froze the imports, which then holds for Horovod's
turns too; see :mod:`mpitrain.core.collector`), in microseconds per tensor.  Rank 0 prints
the table::

    .venv-horovod/bin/mpirun -np 2 .venv-horovod/bin/python benchmarks/engine_overhead.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import mpitrain as hvd


def _timed(fn, repeats: int) -> float:
    """The mean time of ``fn`` over ``repeats`` runs: a pause of Python's cyclic collector
    in one of them is part of what a user pays, which a median would leave out."""
    times = []
    for _ in range(repeats):
        MPI.COMM_WORLD.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.fmean(times)


def patterns(api: Any, label: str,
             tensors: list[torch.Tensor]) -> list[tuple[str, Callable[[], None]]]:
    """The three patterns on ``api``: mpitrain, or horovod.torch (the same calls, by design)."""
    n = len(tensors)

    def run_async() -> None:
        handles = [api.allreduce_async(t, name=f"t.{i}") for i, t in enumerate(tensors)]
        for h in handles:
            api.synchronize(h)

    def run_sync() -> None:
        for i, t in enumerate(tensors):
            api.allreduce(t, name=f"t.{i}")

    def run_grouped() -> None:
        for g in range(0, n, 100):
            api.grouped_allreduce(tensors[g:g + 100], name=f"group.{g}")

    return [(f"{label}async (submit all, then synchronize)", run_async),
            (f"{label}sync (one at a time)", run_sync),
            (f"{label}grouped (100 per call)", run_grouped)]


def horovod() -> Any:
    """horovod.torch when it imports (benchmarks/horovod_peer.sh), not initialised; else None."""
    try:
        import horovod.torch as peer
    except Exception:  # noqa: BLE001 - absent or broken: just not measured
        return None
    return peer


def measure(api: Any, label: str, tensors: list[torch.Tensor],
            repeats: int) -> dict[str, float]:
    """``api``'s three patterns, initialised for them and shut down after: us per tensor."""
    api.init()
    rows = {}
    for name, fn in patterns(api, label, tensors):
        fn()  # warm-up: negotiation caches, numba compilation
        rows[name] = _timed(fn, repeats) / len(tensors) * 1e6
    api.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1000, help="tensors per pattern")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (mean)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="turns of each engine (median over them)")
    args = parser.parse_args()
    hvd.init()
    # The per-call cost in steady state: not while the CPU kernels still load in the
    # background after init() (that doubled the async figure on 2 cores).
    from mpitrain.ops.kernels import cpu

    # (getattr: engine_before_after.sh runs this against commits from before the load.)
    getattr(cpu, "wait_for_warm_up", lambda: None)()
    size = hvd.size()
    hvd.shutdown()
    n = args.ops
    tensors = [torch.full((4,), float(i)) for i in range(n)]
    buf = np.ones(4, dtype=np.float32)
    out = np.empty_like(buf)
    comm = MPI.COMM_WORLD.Dup()

    def run_mpi() -> None:
        for _ in range(n):
            comm.Allreduce(buf, out)

    peer = horovod()
    samples: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        rows = measure(hvd, "", tensors, args.repeats)
        if peer is not None:
            rows.update(measure(peer, "Horovod 0.28 ", tensors, args.repeats))
        run_mpi()
        rows["mpi4py Allreduce (one at a time)"] = _timed(run_mpi, args.repeats) / n * 1e6
        for label, us in rows.items():
            samples.setdefault(label, []).append(us)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"engine overhead, {size} ranks, {n} tensors of 4 float32, median of "
              f"{args.rounds} rounds of the mean of {args.repeats} repeats; "
              f"load {os.getloadavg()[0]:.2f}")
        mpi_us = statistics.median(samples["mpi4py Allreduce (one at a time)"])
        for label, values in samples.items():
            us = statistics.median(values)
            print(f"  {label:52s} {us:8.1f} us/tensor   {us / mpi_us:6.1f}x mpi4py")
    comm.Free()


if __name__ == "__main__":
    main()
