"""CUDA requests without a GPU: the device kind is negotiated, and the executor routes CUDA
buckets to the device layer (a numpy stand-in here) while CPU requests take the CPU path."""

import contextlib

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain.core.dtypes import ReduceOp
from mpitrain.core.errors import MpitrainInternalError
from mpitrain.engine.request import Entry, Kind, Request

MPI_CONFIGS = ("np2",)
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _allreduce_request(name, data, device):
    entry = Entry(input=data, shape=data.shape, dtype="float32", output=data)
    return Request(name=name, kind=Kind.ALLREDUCE, entries=[entry], op=ReduceOp.SUM,
                   device=device)


def test_a_cpu_gpu_mismatch_is_a_clear_error_on_every_rank(hvd):
    engine = hvd.session.engine()
    device = "cuda" if RANK == 1 else "cpu"
    handle = engine.submit(_allreduce_request("mixed.devices", np.ones(4, np.float32), device))
    with pytest.raises(MpitrainInternalError,
                       match="mismatched device for allreduce 'mixed.devices': rank 0 has "
                             "cpu, rank 1 has cuda"):
        handle.wait(timeout=60)


class StandInDevice:
    """Records what the executor hands the device layer; reduces with MPI on host arrays."""

    def __init__(self, group):
        self.group = group
        self.calls = []
        self.staged_entries = 0

    def allreduce(self, inputs, outputs, requests, how):
        self.calls.append((len(inputs), [r.name for r in requests], how.dtype, how.op))
        fused = np.concatenate([x.reshape(-1) for x in inputs]) * how.prescale
        self.group.comm.Allreduce(MPI.IN_PLACE, fused)
        fused *= how.postscale
        offset = 0
        for out in outputs:
            out[...] = fused[offset:offset + out.size].reshape(out.shape)
            offset += out.size

    @contextlib.contextmanager
    def staged(self, entries):
        self.staged_entries += len(entries)
        yield

    def close(self):
        pass


def test_cuda_buckets_go_to_the_device_layer_fused_and_cpu_ones_do_not(hvd):
    engine = hvd.session.engine()
    executor = engine.process_set(0).executor
    real = executor.device
    executor.device = stand_in = StandInDevice(executor.group)
    try:
        gpu = [np.full(3, RANK + i, np.float32) for i in range(3)]
        cpu = np.full(5, float(RANK), np.float32)
        handles = [engine.submit(_allreduce_request(f"gpu.{i}", g, "cuda"))
                   for i, g in enumerate(gpu)]
        handles.append(engine.submit(_allreduce_request("cpu.0", cpu, "cpu")))
        for h in handles:
            h.wait(timeout=60)
        for i, g in enumerate(gpu):
            np.testing.assert_array_equal(g, sum(r + i for r in range(SIZE)))
        np.testing.assert_array_equal(cpu, sum(range(SIZE)))
        # Only CUDA tensors reached the device layer; the CPU one never did.
        names = [n for call in stand_in.calls for n in call[1]]
        assert sorted(names) == ["gpu.0", "gpu.1", "gpu.2"]
        assert all(call[2] == "float32" and call[3] == ReduceOp.SUM for call in stand_in.calls)

        # A CUDA broadcast is staged and run on its own.
        data = np.full(4, float(RANK), np.float32)
        entry = Entry(input=None, shape=(4,), dtype="float32", output=data)
        request = Request(name="gpu.bcast", kind=Kind.BROADCAST, entries=[entry], root=1,
                          device="cuda")
        engine.submit(request).wait(timeout=60)
        np.testing.assert_array_equal(data, 1.0)
        assert stand_in.staged_entries == 1
    finally:
        executor.device = real
