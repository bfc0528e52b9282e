"""Find which step of the multi-rank GPU allreduce fails, one primitive at a time.

On the lent H100 (2026-11-26) every allreduce of CUDA tensors at 2 and 4 ranks sharing the GPU
ended in ``cudaErrorIllegalAddress`` while the same code at one rank passed; there was no
device time left to find the kernel.  This probe walks from the bottom up, synchronising
after each step (run it with ``CUDA_LAUNCH_BLOCKING=1``, or under ``compute-sanitizer``), and
stops at the first failure, since a CUDA error poisons the context for every later step::

    CUDA_LAUNCH_BLOCKING=1 mpirun -np 2 python scripts/gpu_ipc_probe.py
    mpirun -np 2 compute-sanitizer --print-limit 5 python scripts/gpu_ipc_probe.py

Steps: cupy reads a peer's IPC window; cudaMemcpyAsync from it; the numba reduce kernel over
[own, peer]; ``ipc.allreduce`` on one window; ``DeviceGroup.allreduce`` of one array in place,
then of three arrays (the pack kernel), then forced host staging; ``hvd.allreduce`` of a torch
tensor.  Every rank prints ``step NAME: ok`` or the error; the exit status is 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

import numpy as np

import mpitrain as hvd  # isort: skip - before mpi4py, which starts MPI (see mpitrain._mpi)
from mpi4py import MPI

from mpitrain.dtypes import ReduceOp
from mpitrain.ops import cuda as gpu

N = 1 << 18  # float32 elements per buffer (1 MiB)


def expected_sum(size: int) -> float:
    return float(sum(r + 1 for r in range(size)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args()
    if not gpu.available():
        print(f"gpu_ipc_probe: {gpu.probe._probe()[1]}", file=sys.stderr)
        return 2
    hvd.init()
    import cupy
    import torch
    from numba import cuda as numba_cuda

    from mpitrain.ops.cuda import ipc, kernels
    from mpitrain.ops.cuda.allreduce import DeviceGroup
    from mpitrain.ops.cuda.transport import Transport

    rank, size = hvd.rank(), hvd.size()
    local = hvd.session.engine().process_set(0).group.comms.local
    if local.Get_size() < 2:
        print("gpu_ipc_probe: needs at least 2 ranks on this node (mpirun -np 2)",
              file=sys.stderr)
        return 2
    group = hvd.session.engine().process_set(0).group
    runtime = ipc.CupyIpc(cupy)
    state: dict[str, object] = {}

    def own_and_peer() -> None:
        own = runtime.allocate(N * 4)
        view = runtime.view(own, np.dtype(np.float32), 0, N)
        view.fill(rank + 1)
        cupy.cuda.runtime.deviceSynchronize()
        handles = local.allgather(runtime.handle(own))
        peer_rank = (local.Get_rank() + 1) % local.Get_size()
        peer = runtime.open(handles[peer_rank], N * 4)
        state.update(own=own, view=view, peer=peer, peer_rank=peer_rank)
        got = runtime.view(peer, np.dtype(np.float32), 0, N).get()
        assert np.all(got == peer_rank + 1), f"peer window holds {got[:4]}"

    def memcpy_from_peer() -> None:
        dst = cupy.empty(N, dtype=np.float32)
        src = runtime.view(state["peer"], np.dtype(np.float32), 0, N)
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, N * 4,
                                      cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
        stream.synchronize()
        assert float(dst[0]) == state["peer_rank"] + 1  # type: ignore[operator]

    def numba_kernel_over_peer() -> None:
        peer = runtime.view(state["peer"], np.dtype(np.float32), 0, N)
        out = cupy.empty(N, dtype=np.float32)

        def nb(a: object) -> object:
            return numba_cuda.from_cuda_array_interface(
                a.__cuda_array_interface__, owner=a, sync=False)  # type: ignore[attr-defined]

        stream = cupy.cuda.Stream(non_blocking=True)
        kernels.reduce_buffers([nb(state["view"]), nb(peer)], nb(out), "float32",
                               ReduceOp.SUM, 1.0, 1.0, None,
                               numba_cuda.external_stream(stream.ptr))
        stream.synchronize()
        want = rank + 1 + state["peer_rank"] + 1  # type: ignore[operator]
        assert float(out[0]) == want and float(out[-1]) == want, f"got {out[:4]}"
        runtime.close(state["peer"])
        local.Barrier()

    def device_group(force: Transport | None, tensors: int) -> Callable[[], None]:
        def run() -> None:
            dg = DeviceGroup(group, cuda_aware=False, force=force)
            try:
                arrays = [cupy.full(N // tensors + i, rank + 1, dtype=np.float32)
                          for i in range(tensors)]
                stream = cupy.cuda.get_current_stream()
                with dg.on_device():
                    dg.allreduce(arrays, arrays, "float32", ReduceOp.SUM, 1.0, 1.0, [],
                                 [stream])
                stream.synchronize()
                for a in arrays:
                    got = a.get()
                    assert np.all(got == expected_sum(size)), f"got {got[:4]}"
            finally:
                dg.close()
                group.comm.Barrier()
        return run

    def torch_allreduce() -> None:
        x = torch.full((N,), float(rank + 1), device="cuda")
        hvd.allreduce_(x, op=hvd.Sum, name="probe")
        torch.cuda.synchronize()
        assert bool(torch.all(x == expected_sum(size))), f"got {x[:4]}"

    steps: list[tuple[str, Callable[[], None]]] = [
        ("cupy reads a peer's IPC window", own_and_peer),
        ("cudaMemcpyAsync from a peer's window", memcpy_from_peer),
        ("numba reduce kernel over [own, peer]", numba_kernel_over_peer),
        ("DeviceGroup.allreduce, 1 array in place", device_group(None, 1)),
        ("DeviceGroup.allreduce, 3 arrays (pack kernel)", device_group(None, 3)),
        ("DeviceGroup.allreduce, host staging", device_group(Transport.HOST_STAGING, 3)),
        ("hvd.allreduce_ of a torch tensor", torch_allreduce),
    ]
    for name, step in steps:
        try:
            step()
            cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # noqa: BLE001 - the probe reports and stops
            print(f"rank {rank}: step {name}: FAILED\n{traceback.format_exc()}", flush=True)
            MPI.COMM_WORLD.Abort(1)
        print(f"rank {rank}: step {name}: ok", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
