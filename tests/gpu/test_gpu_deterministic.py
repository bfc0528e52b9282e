"""MPITRAIN_DETERMINISTIC on a real GPU: the CPU's bits, whatever the transport and channels.

The device kernels and the fused multiply-adds NVVM forms are what the simulator cannot show:
here every design's result on device buffers must equal its numpy statement bit for bit (the
CPU data plane's result, tests/mpi/test_deterministic.py), through CUDA IPC, the hierarchical
IPC path (2x2), CUDA-aware MPI where the library has it, and host staging, with one and two
channels; and CUDA tensors through the engine must give the bits of the same CPU tensors.
"""

import dataclasses
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitrain.core.dtypes import STORAGE, ReduceOp
from mpitrain.engine.device import cuda_awareness
from mpitrain.ops import fixed_point, reference
from mpitrain.ops.cuda.allreduce import DeviceGroup
from mpitrain.ops.cuda.transport import Transport
from mpitrain.ops.reduction import Reduction

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MODES = ("rank-order", "fixed-point")
FLOATS = ("float32", "float16", "bfloat16", "float64")


def _mixed(rank, n, dtype, seed):
    """Magnitudes over six decades, so that the order of additions shows in the bits."""
    gen = np.random.default_rng([rank, n, seed])
    data = (gen.normal(size=n) * 10.0 ** gen.integers(-3, 3, n)).astype(np.float32)
    return reference.f32_to_bf16(data) if dtype == "bfloat16" else data.astype(STORAGE[dtype])


def _want(mode, inputs, dtype, pre, post):
    if mode == "fixed-point":
        return fixed_point.reference(inputs, dtype, pre, post)
    return reference.reduce(inputs, dtype, ReduceOp.SUM, pre, post)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("force", [None, Transport.HOST_STAGING, Transport.CUDA_AWARE_MPI])
@pytest.mark.parametrize("streams", [1, 2])
def test_device_buckets_give_the_designs_bits(hvd, cupy, mode, force, streams):
    base = hvd.session.engine().process_set(0).group
    if force == Transport.CUDA_AWARE_MPI and not cuda_awareness(base.config.cuda_aware_mpi) \
            .supported:
        pytest.skip("this MPI takes no device pointers")
    group = dataclasses.replace(base, config=dataclasses.replace(
        base.config, deterministic=mode, allreduce_streams=streams))
    dg = DeviceGroup(group, cuda_aware=force == Transport.CUDA_AWARE_MPI, force=force)
    try:
        for dtype in FLOATS:
            sizes = [1, 1000, 3_000_001]  # 12 MB of float32: every channel, chunk and window
            pre, post = (0.5, 1.0 / SIZE)
            inputs = [[_mixed(r, n, dtype, i) for i, n in enumerate(sizes)] for r in range(SIZE)]
            xs = [cupy.asarray(x) for x in inputs[RANK]]
            outs = [cupy.zeros_like(x) for x in xs]
            stream = cupy.cuda.get_current_stream()
            how = Reduction(dtype, pre, post, ReduceOp.SUM)
            dg.allreduce(xs, outs, how, [], [stream])
            dg.allreduce(xs[1:2], xs[1:2], how, [], [stream])
            stream.synchronize()
            for i, out in enumerate(outs):
                want = _want(mode, [inputs[r][i] for r in range(SIZE)], dtype, pre, post)
                assert cupy.asnumpy(out).tobytes() == want.tobytes(), (dtype, sizes[i])
            want = _want(mode, [inputs[r][1] for r in range(SIZE)], dtype, pre, post)
            assert cupy.asnumpy(xs[1]).tobytes() == want.tobytes(), (dtype, "in place")
    finally:
        dg.close()


@pytest.mark.parametrize("mode", MODES)
def test_cuda_tensors_through_the_engine_give_the_cpu_tensors_bits(hvd, mode):
    hvd.shutdown()
    os.environ["MPITRAIN_DETERMINISTIC"] = mode
    os.environ["MPITRAIN_FUSION_THRESHOLD"] = str(1 << 20)
    hvd.init()
    try:
        for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            tensors = [torch.from_numpy(_mixed(RANK, n, "float32", i)).to(torch_dtype)
                       for i, n in enumerate([7, 50_000, 400_003])]
            on_cpu = [hvd.allreduce_async(t, name=f"det.cpu.{dtype}.{i}")
                      for i, t in enumerate(tensors)]
            on_gpu = [hvd.allreduce_async(t.cuda(), name=f"det.gpu.{dtype}.{i}")
                      for i, t in enumerate(tensors)]
            for c, g in zip(on_cpu, on_gpu):
                a, b = hvd.synchronize(c), hvd.synchronize(g).cpu()
                assert a.view(torch.uint8).numpy().tobytes() == \
                    b.view(torch.uint8).numpy().tobytes(), dtype
    finally:
        hvd.shutdown()
        del os.environ["MPITRAIN_DETERMINISTIC"], os.environ["MPITRAIN_FUSION_THRESHOLD"]
        hvd.init()
