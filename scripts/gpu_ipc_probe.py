"""Find which step of the multi-rank GPU allreduce fails, one primitive at a time.

On the lent H100 (2026-11-26) every allreduce of CUDA tensors at 2 and 4 ranks sharing the GPU
ended in ``cudaErrorIllegalAddress`` while the same code at one rank passed.  Each step here is
one primitive of that path, and sets up what it needs itself, so a step can run alone in a
fresh job (``--step NAME``; a CUDA error poisons the context for every later step of the same
process).  Run it with ``CUDA_LAUNCH_BLOCKING=1`` (errors surface at the failing launch) or
under ``compute-sanitizer`` (which names the kernel and the address)::

    CUDA_LAUNCH_BLOCKING=1 mpirun -np 2 python scripts/gpu_ipc_probe.py --list
    CUDA_LAUNCH_BLOCKING=1 mpirun -np 2 python scripts/gpu_ipc_probe.py --step peer_numba
    mpirun -np 2 compute-sanitizer --print-limit 5 python scripts/gpu_ipc_probe.py --step torch

Without ``--step`` every step runs in order in one process and the first failure stops it.
Every rank prints ``step NAME: ok`` or the error with its traceback; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

import mpitrain as hvd  # isort: skip - before mpi4py, which starts MPI (see mpitrain.core._mpi)
from mpi4py import MPI

from mpitrain.core.dtypes import ReduceOp
from mpitrain.ops import cuda as gpu
from mpitrain.ops.reduction import Reduction

N = 1 << 18  # float32 elements per buffer (1 MiB)


class Probe:
    """The shared setup of the steps: MPI, the local communicator, cupy/numba/torch."""

    def __init__(self) -> None:
        hvd.init()
        import cupy
        import torch
        from numba import cuda as numba_cuda

        from mpitrain.ops.cuda import ipc, kernels

        self.cupy, self.torch, self.numba_cuda = cupy, torch, numba_cuda
        self.kernels = kernels
        self.rank, self.size = hvd.rank(), hvd.size()
        self.group = hvd.session.engine().process_set(0).group
        self.local = self.group.comms.local
        self.runtime = ipc.CupyIpc(cupy)
        self.peer_rank = (self.local.Get_rank() + 1) % self.local.Get_size()

    def expected_sum(self) -> float:
        return float(sum(r + 1 for r in range(self.size)))

    def nb(self, a: Any) -> Any:
        return self.numba_cuda.from_cuda_array_interface(a.__cuda_array_interface__, owner=a,
                                                         sync=False)

    def windows(self) -> tuple[Any, Any, Any]:
        """(own memory, a float32 view of it holding rank+1, the peer's window opened)."""
        own = self.runtime.allocate(N * 4)
        view = self.runtime.view(own, np.dtype(np.float32), 0, N)
        view.fill(self.rank + 1)
        self.cupy.cuda.runtime.deviceSynchronize()
        handles = self.local.allgather(self.runtime.handle(own))
        peer = self.runtime.open(handles[self.peer_rank], N * 4)
        return own, view, peer

    def peer_view(self, peer: Any) -> Any:
        return self.runtime.view(peer, np.dtype(np.float32), 0, N)

    def done_with(self, peer: Any) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()
        self.runtime.close(peer)
        self.local.Barrier()  # nobody frees its window while a peer still maps it

    # ------------------------------------------------------------------------ steps
    def peer_read(self) -> None:
        """cupy copies a peer's IPC window to the host."""
        own, _view, peer = self.windows()
        got = self.peer_view(peer).get()
        assert np.all(got == self.peer_rank + 1), f"peer window holds {got[:4]}"
        self.done_with(peer)

    def peer_memcpy(self) -> None:
        """cudaMemcpyAsync device to device from a peer's window, on a non-blocking stream."""
        own, _view, peer = self.windows()
        dst = self.cupy.empty(N, dtype=np.float32)
        stream = self.cupy.cuda.Stream(non_blocking=True)
        rt = self.cupy.cuda.runtime
        rt.memcpyAsync(dst.data.ptr, self.peer_view(peer).data.ptr, N * 4,
                       rt.memcpyDeviceToDevice, stream.ptr)
        stream.synchronize()
        assert float(dst[0]) == self.peer_rank + 1, f"got {dst[:4]}"
        self.done_with(peer)

    def peer_cupy_kernel(self) -> None:
        """A cupy elementwise kernel reads own + peer window (any kernel over an IPC pointer)."""
        own, view, peer = self.windows()
        out = view + self.peer_view(peer)
        self.cupy.cuda.runtime.deviceSynchronize()
        want = self.rank + 1 + self.peer_rank + 1
        assert float(out[0]) == want and float(out[-1]) == want, f"got {out[:4]}"
        self.done_with(peer)

    def _numba_reduce(self, inputs: list[Any], want: float) -> None:
        out = self.cupy.empty(N, dtype=np.float32)
        stream = self.cupy.cuda.Stream(non_blocking=True)
        self.kernels.reduce_buffers([self.nb(x) for x in inputs], self.nb(out),
                                    Reduction("float32", op=ReduceOp.SUM), None,
                                    self.kernels.LaunchConfig(
                                        self.numba_cuda.external_stream(stream.ptr)))
        stream.synchronize()
        assert float(out[0]) == want and float(out[-1]) == want, f"got {out[:4]}"

    def own_numba(self) -> None:
        """The numba reduce kernel over two buffers of this process (no IPC): control."""
        a = self.cupy.full(N, 1.0, dtype=np.float32)
        b = self.cupy.full(N, 2.0, dtype=np.float32)
        self._numba_reduce([a, b], 3.0)

    def peer_numba(self) -> None:
        """The numba reduce kernel over [own window, peer window]."""
        own, view, peer = self.windows()
        self._numba_reduce([view, self.peer_view(peer)], self.rank + 1 + self.peer_rank + 1)
        self.done_with(peer)

    def _in_thread(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a new thread made current on this GPU, as the engine's thread is."""
        errors: list[BaseException] = []

        def body() -> None:
            try:
                with self.cupy.cuda.Device(0), self.numba_cuda.gpus[0]:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(exc)
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    def own_numba_thread(self) -> None:
        """The control kernel launched from another thread (the engine launches from one)."""
        self._in_thread(self.own_numba)

    def peer_numba_thread(self) -> None:
        """The reduce over [own, peer] from another thread; the window opened on it too."""
        self._in_thread(self.peer_numba)

    def pack(self) -> None:
        """The pack kernel (cupy RawKernel over a pointer table), three arrays, no IPC."""
        from mpitrain.ops.cuda.pack import Packer
        arrays = [self.cupy.full(N // 3 + i, float(i + 1), dtype=np.float32) for i in range(3)]
        fused = self.cupy.zeros(sum(a.nbytes for a in arrays), dtype=np.uint8)
        packer = Packer([int(a.data.ptr) for a in arrays], [int(a.nbytes) for a in arrays],
                        int(fused.data.ptr))
        stream = self.cupy.cuda.Stream(non_blocking=True)
        packer.pack(fused, stream)
        stream.synchronize()
        want = np.concatenate([a.get() for a in arrays])
        assert np.array_equal(fused.view(np.float32).get(), want), "packed bytes differ"

    def _device_group(self, force: Any, tensors: int) -> None:
        from mpitrain.ops.cuda.allreduce import DeviceGroup
        dg = DeviceGroup(self.group, cuda_aware=False, force=force)
        try:
            arrays = [self.cupy.full(N // tensors + i, self.rank + 1, dtype=np.float32)
                      for i in range(tensors)]
            stream = self.cupy.cuda.get_current_stream()
            with dg.on_device():
                dg.allreduce(arrays, arrays, Reduction("float32", op=ReduceOp.SUM), [],
                             [stream])
            stream.synchronize()
            for a in arrays:
                got = a.get()
                assert np.all(got == self.expected_sum()), f"got {got[:4]}"
        finally:
            dg.close()
            self.group.comm.Barrier()

    def dg_one(self) -> None:
        """DeviceGroup.allreduce of one array in place over CUDA IPC."""
        self._device_group(None, 1)

    def dg_three(self) -> None:
        """DeviceGroup.allreduce of three arrays (pack kernel into the IPC window)."""
        self._device_group(None, 3)

    def dg_staging(self) -> None:
        """DeviceGroup.allreduce of three arrays through pinned host memory (no IPC)."""
        from mpitrain.ops.cuda.transport import Transport
        self._device_group(Transport.HOST_STAGING, 3)

    def dg_thread(self) -> None:
        """DeviceGroup.allreduce over IPC from another thread, as the engine runs it."""
        self._in_thread(self.dg_three)

    def torch_one(self) -> None:
        """hvd.allreduce_ of a torch tensor (the engine, its thread, the chosen transport)."""
        torch = self.torch
        x = torch.full((N,), float(self.rank + 1), device="cuda")
        hvd.allreduce_(x, op=hvd.Sum, name="probe")
        torch.cuda.synchronize()
        assert bool(torch.all(x == self.expected_sum())), f"got {x[:4]}"

    def torch_grouped(self) -> None:
        """Three torch tensors in one bucket (pack/unpack around the IPC allreduce)."""
        torch = self.torch
        xs = [torch.full((N // 3 + i,), float(self.rank + 1), device="cuda") for i in range(3)]
        hvd.grouped_allreduce_(xs, op=hvd.Sum, name="probe_grouped")
        torch.cuda.synchronize()
        for x in xs:
            assert bool(torch.all(x == self.expected_sum())), f"got {x[:4]}"


    def torch_repeat(self) -> None:
        """The same torch tensor allreduced ten times (cached packer, window reused)."""
        torch = self.torch
        x = torch.ones(N, device="cuda")
        for i in range(10):
            hvd.allreduce_(x, op=hvd.Sum, name="probe_repeat")
            torch.cuda.synchronize()
            want = float(self.size) ** (i + 1)
            assert bool(torch.all(x == want)), f"round {i}: got {x[:4]}, want {want}"

    def torch_sizes(self) -> None:
        """1, 4, 16, 64 MiB, three times each, memory returned between sizes (the window
        grows; the allocator hands addresses out again), as benchmarks/gpu_allreduce.py."""
        torch = self.torch
        for mib in (1, 4, 16, 64):
            x = torch.full((mib << 18,), float(self.rank + 1), device="cuda")
            for _ in range(3):
                y = x.clone()
                hvd.allreduce_(y, op=hvd.Sum, name=f"probe_sizes.{mib}")
                torch.cuda.synchronize()
                assert bool(torch.all(y == self.expected_sum())), f"{mib} MiB: got {y[:4]}"
            del x, y
            torch.cuda.empty_cache()


STEPS = ["peer_read", "peer_memcpy", "peer_cupy_kernel", "own_numba", "peer_numba",
         "own_numba_thread", "peer_numba_thread", "pack", "dg_one", "dg_three", "dg_staging",
         "dg_thread", "torch_one", "torch_grouped", "torch_repeat", "torch_sizes"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step", choices=STEPS, action="append",
                        help="run only this step (repeatable); default: all, in order")
    parser.add_argument("--list", action="store_true", help="print the step names and exit")
    args = parser.parse_args()
    if args.list:
        for name in STEPS:
            print(f"{name:18s} {getattr(Probe, name).__doc__}")
        return 0
    if not gpu.available():
        print(f"gpu_ipc_probe: {gpu.probe._probe()[1]}", file=sys.stderr)
        return 2
    probe = Probe()
    if probe.local.Get_size() < 2:
        print("gpu_ipc_probe: needs at least 2 ranks on this node (mpirun -np 2)",
              file=sys.stderr)
        return 2
    for name in args.step or STEPS:
        try:
            getattr(probe, name)()
            probe.cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # noqa: BLE001 - the probe reports and stops
            print(f"rank {probe.rank}: step {name}: FAILED\n{traceback.format_exc()}",
                  flush=True)
            MPI.COMM_WORLD.Abort(1)
        print(f"rank {probe.rank}: step {name}: ok", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
