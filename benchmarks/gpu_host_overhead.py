"""Host time per device allreduce: what one call costs the CPU, and where that time goes.

The engine hands a bucket to the GPU data plane (``engine/device.py: DeviceLayer.allreduce``);
this times that call from the host's side, for one tensor and for a bucket of 64 tensors of
1 MiB together, on each transport and with 1 and 2 channels, in the steady state (the same
layout every call, as gradients in training).  Per configuration: the median and p95 host time
per call (until the call returns, the device work merely enqueued) and, on a GPU, until the
device has finished too; then one profiled pass splits the host time between mpitrain's own
Python, cupy, numba and MPI (cProfile's count of Python calls per allreduce, which no load
changes, and each category's share of the profiled time, grouped by the file a function lives
in).  On a GPU it runs both launch paths, numba's
dispatch and the prepared launches (mpitrain.ops.cuda.launch), in the same job::

    mpirun -np 2 python benchmarks/gpu_host_overhead.py --json host_np2.json     # on a GPU
    python benchmarks/gpu_host_overhead.py --fake                                # on a CPU
    mpirun -np 2 python benchmarks/gpu_host_overhead.py --fake

``--fake`` runs on the CPU: the tests' fake cupy (tests/fake_cuda.py) stands for the device,
with its kernels counted but not run, so only the host's work is timed (mpitrain's Python,
the fake's stand-ins for cupy calls, MPI); it also prints the fake's ledger of device
operations per call.  Its "numba" is the simulator's dispatch, not numba's: the launch paths
are compared on a GPU only.  Rank 0 prints a markdown table; ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import inspect
import json
import os
import pstats
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BYTES = 1 << 20


def _setup(fake: bool) -> Any:
    """cupy (the fake one with ``--fake``); MPI is started by mpitrain.init() afterwards."""
    if not fake:
        import cupy
        return cupy
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    import numba

    numba.config.reload_config()
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda

    cupy = fake_cuda.install_cupy()
    fake_cuda.count_simulator_launches()
    fake_cuda.NULL_KERNELS = True
    return cupy


def _category(where: str) -> str:
    """mpitrain, cupy (the fake's stand-ins with --fake), numba, mpi or other (numpy, the
    standard library, built-ins), by the file a function lives in or a built-in's name."""
    if "mpitrain" in where and "fake_cuda" not in where:
        return "mpitrain"
    if "fake_cuda" in where or "cupy" in where:
        return "cupy"
    if "numba" in where:
        return "numba"
    if "mpi4py" in where or "Comm" in where:
        return "mpi"
    return "other"


class _Case:
    """One configuration: a DeviceLayer (the engine's door) over its own DeviceGroup."""

    def __init__(self, hvd: Any, cupy: Any, spec: dict[str, Any]) -> None:
        from mpitrain.engine import device
        from mpitrain.ops.cuda.allreduce import DeviceGroup

        self.cupy, self.device = cupy, device
        group = hvd.session.engine().process_set(0).group
        group = dataclasses.replace(group, config=dataclasses.replace(
            group.config, allreduce_streams=spec["channels"]))
        kwargs: dict[str, Any] = {}
        if spec["transport"] != "chosen":
            from mpitrain.ops.cuda.transport import Transport
            kwargs["force"] = Transport(spec["transport"])
        if "launcher" in inspect.signature(DeviceGroup).parameters:  # not before this change
            from numba import cuda as numba_cuda

            from mpitrain.ops.cuda import launch
            if spec["launcher"] == "numba":
                kwargs["launcher"] = launch.Launcher(None, numba_cuda)
        aware = spec["transport"] == "cuda-aware-mpi"
        self.layer = device.DeviceLayer(group)
        self.layer._device_group = DeviceGroup(group, aware, **kwargs)
        count = TOTAL_BYTES // 4
        sizes = [count // spec["tensors"]] * spec["tensors"]
        self.tensors = [cupy.asarray(np.ones(n, np.float32)) for n in sizes]
        self.stream = cupy.cuda.get_current_stream()
        pointer = int(getattr(self.stream, "ptr", 0))
        self.pointer = pointer

    def requests(self) -> list[Any]:
        """The bucket's requests, each with the event the front door records at submission
        (made outside the timing: that is the submitting thread's cost, not this call's)."""
        return [types.SimpleNamespace(ready=self.device.mark_ready([self.pointer]))
                for _ in self.tensors]

    def call(self, requests: list[Any]) -> None:
        # Average over 2 ranks, as gradients are: a postscale of 1/2 (at one rank too).
        self.layer.allreduce(self.tensors, self.tensors, requests, _average_of_two())

    def close(self) -> None:
        self.layer.close()


def _profile(case: _Case, calls: int) -> dict[str, float]:
    """Per category: Python function calls per allreduce (cProfile's count: the same under any
    load) and the share of the profiled time spent in its own code (%; the profiler's own
    cost per function call inflates every category alike)."""
    batches = [case.requests() for _ in range(calls)]
    profiler = cProfile.Profile()
    profiler.enable()
    for requests in batches:
        case.call(requests)
    profiler.disable()
    counts: Counter = Counter()
    times: Counter = Counter()
    stats: Any = pstats.Stats(profiler)
    for (filename, _, name), row in stats.stats.items():
        where = filename if filename != "~" else name  # built-ins: "<method 'Barrier' ...>"
        category = _category(where)
        counts[category] += row[1]  # primitive calls
        times[category] += row[2]  # own time
    total = sum(times.values()) or 1.0
    out = {f"{k}_calls": counts[k] / calls for k in sorted(counts)}
    out.update({f"{k}_pct": 100 * times[k] / total for k in sorted(times)})
    return out


def _average_of_two() -> Any:
    from mpitrain.core.dtypes import ReduceOp
    from mpitrain.ops.reduction import Reduction
    return Reduction("float32", 1.0, 0.5, ReduceOp.SUM)


def _measure(case: _Case, comm: Any, repeats: int, fake: bool) -> dict[str, Any]:
    for _ in range(3):  # the first calls see a new layout: tables, windows, compiles
        case.call(case.requests())
    case.stream.synchronize()
    host, device = [], []
    for _ in range(repeats):
        requests = case.requests()
        comm.Barrier()
        start = time.perf_counter()
        case.call(requests)
        returned = time.perf_counter()
        case.stream.synchronize()
        host.append(returned - start)
        device.append(time.perf_counter() - start)
    row: dict[str, Any] = {
        "host_us_p50": statistics.median(host) * 1e6,
        "host_us_p95": float(np.percentile(host, 95)) * 1e6}
    if not fake:
        row["done_us_p50"] = statistics.median(device) * 1e6
    comm.Barrier()
    row.update(_profile(case, repeats))
    case.stream.synchronize()
    if fake:
        import fake_cuda
        requests = case.requests()
        fake_cuda.reset_ledger()
        case.call(requests)
        row["ops"] = dict(sorted(fake_cuda.ledger().items()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="the tests' fake device (CPU)")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cupy = _setup(args.fake)
    import mpitrain as hvd

    hvd.init()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    launchers = ["default"] if args.fake else ["numba", "prepared"]
    transports = ["chosen", "host-staging", "cuda-aware-mpi"]
    rows = []
    for transport in transports:
        for channels in (1, 2):
            for tensors in (1, 64):
                for launcher in launchers:
                    spec = {"transport": transport, "channels": channels, "tensors": tensors,
                            "launcher": launcher}
                    case = _Case(hvd, cupy, spec)
                    try:
                        rows.append({**spec, "ranks": comm.Get_size(),
                                     **_measure(case, comm, args.repeats, args.fake)})
                    finally:
                        case.close()
    if comm.Get_rank() == 0:
        keys = list(dict.fromkeys(k for r in rows for k in r if k != "ops"))
        print("| " + " | ".join(keys) + " |")
        print("|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{r[k]:.1f}" if isinstance(r.get(k), float)
                                   else str(r.get(k, "-")) for k in keys) + " |")
        if args.fake:
            print("\ndevice operations per call (fake device ledger):")
            for r in rows:
                print(f"  {r['transport']}, {r['channels']} channel(s), {r['tensors']} "
                      f"tensor(s): {r['ops']}")
        load = os.getloadavg()
        print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "load": load}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
