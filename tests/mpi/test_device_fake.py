"""The GPU data plane end to end on the CPU: a fake cupy whose device memory is host (and, for
CUDA IPC, POSIX shared) memory, numba's CUDA simulator for the kernels, and the real engine,
negotiation, DeviceGroup, IPC windows, channels, staging and CUDA-aware paths under mpirun.

What this cannot show (stream concurrency, real copies, speed) is for tests/gpu on a GPU.
"""

import dataclasses
import os
import sys

import numba
import numpy as np
import pytest
from mpi4py import MPI

os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
assert "numba.cuda" not in sys.modules, "numba.cuda was imported before the simulator was set"
numba.config.reload_config()

import fake_cuda  # noqa: E402

cupy = fake_cuda.install_cupy()

from numba import cuda as numba_cuda  # noqa: E402

from mpitrain.core.dtypes import ReduceOp  # noqa: E402
from mpitrain.ops import reference  # noqa: E402
from mpitrain.ops.cuda import ipc, kernels, launch, streams  # noqa: E402
from mpitrain.ops.cuda.allreduce import DeviceGroup  # noqa: E402
from mpitrain.ops.cuda.transport import Transport  # noqa: E402
from mpitrain.ops.reduction import Reduction  # noqa: E402

MPI_CONFIGS = ("np1", "np2", "2x2")
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# The simulator runs one Python thread per CUDA thread: keep launches and slices small.
kernels.THREADS, kernels.MAX_BLOCKS = 16, 2
streams.MIN_CHUNK_BYTES = 256
ipc.MIN_WINDOW_BYTES = 1024


def _host(rank, n, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.random(n) * 2 + 0.5).astype(dtype)
    return rng.integers(0, 7, n).astype(dtype)


def _want(n, dtype, op, pre, post, seed=0):
    inputs = [_host(r, n, dtype, seed) for r in range(SIZE)]
    if op == ReduceOp.AVERAGE:
        op, post = ReduceOp.SUM, post / SIZE
    return reference.reduce(inputs, np.dtype(dtype).name, op, pre, post)


def _close(got, want):
    got = np.asarray(got)
    if got.dtype.kind == "f":
        tol = 1e-2 if got.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol)
    else:
        np.testing.assert_array_equal(got, want)


def _device_group(hvd, **config):
    group = hvd.session.engine().process_set(0).group
    if config:
        group = dataclasses.replace(group, config=dataclasses.replace(group.config, **config))
    return group


@pytest.mark.parametrize(("dtype", "op", "pre", "post"), [
    (np.float32, ReduceOp.SUM, 0.5, 2.0), (np.float32, ReduceOp.AVERAGE, 1.0, 1.0),
    (np.float16, ReduceOp.SUM, 1.0, 0.5), (np.int32, ReduceOp.MAX, 1.0, 1.0),
    (np.float64, ReduceOp.PRODUCT, 1.0, 1.0)])
def test_device_arrays_through_the_public_api(hvd, dtype, op, pre, post):
    n = 301
    x = cupy.asarray(_host(RANK, n, dtype))
    out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                        name=f"dev.{np.dtype(dtype).name}.{op.name}")
    assert isinstance(out, cupy.ndarray) and out.dtype == np.dtype(dtype)
    _close(out, _want(n, dtype, op, pre, post))


def test_a_fused_bucket_is_packed_reduced_and_unpacked(hvd):
    arrays = [cupy.asarray(_host(RANK, 5 + 13 * i, np.float32, seed=i)) for i in range(12)]
    handles = [hvd.allreduce_async_(a, op=hvd.Sum, name=f"fused.{i}")
               for i, a in enumerate(arrays)]
    for h in handles:
        hvd.synchronize(h)
    for i, a in enumerate(arrays):
        _close(a, _want(5 + 13 * i, np.float32, ReduceOp.SUM, 1.0, 1.0, seed=i))


def test_the_transport_follows_the_topology(hvd):
    hvd.allreduce(cupy.asarray(np.ones(4, np.float32)), name="probe")
    dg = hvd.session.engine().process_set(0).executor.device._device_group
    topo = hvd.core.runtime.state().topology
    kinds = [t for _, t in dg.phases]
    if topo.size == 1:  # a world of one moves nothing
        assert kinds == [Transport.LOCAL]
    elif topo.local_size == 1:
        assert kinds == [Transport.HOST_STAGING]
    elif topo.num_nodes == 1:
        assert kinds == [Transport.CUDA_IPC]
    else:
        assert kinds == [Transport.CUDA_IPC, Transport.HOST_STAGING, Transport.CUDA_IPC]
    if dg.window is not None:  # every peer's window opened once per export
        assert cupy.cuda.runtime.opened == (topo.local_size - 1) * dg.window.exchanges


@pytest.mark.parametrize("force", [Transport.HOST_STAGING, Transport.CUDA_AWARE_MPI])
@pytest.mark.parametrize("dtype", [np.float16, np.int32])
def test_forced_transports_with_two_channels(hvd, force, dtype):
    dg = DeviceGroup(_device_group(hvd, allreduce_streams=2),
                     cuda_aware=force == Transport.CUDA_AWARE_MPI, force=force)
    try:
        n = 1000  # > 2 slices of MIN_CHUNK_BYTES: both channels carry data
        x = cupy.asarray(_host(RANK, n, dtype, seed=3))
        stream = cupy.cuda.get_current_stream()
        pre, post = (0.5, 4.0) if dtype == np.float16 else (1.0, 1.0)
        dg.allreduce([x], [x], Reduction(np.dtype(dtype).name, pre, post, ReduceOp.SUM), [],
                     [stream])
        _close(x, _want(n, dtype, ReduceOp.SUM, pre, post, seed=3))
    finally:
        dg.close()


def test_ipc_with_two_channels_and_growing_windows(hvd):
    dg = DeviceGroup(_device_group(hvd, allreduce_streams=2), cuda_aware=False)
    try:
        stream = cupy.cuda.get_current_stream()
        for n in (100, 1500):  # the second outgrows the first (1 KiB) window
            xs = [cupy.asarray(_host(RANK, n // 3 + i, np.float32, seed=i)) for i in range(3)]
            dg.allreduce(xs, xs, Reduction("float32", op=ReduceOp.SUM), [], [stream])
            for i, x in enumerate(xs):
                _close(x, _want(n // 3 + i, np.float32, ReduceOp.SUM, 1.0, 1.0, seed=i))
        if dg.window is not None:
            assert dg.window.exchanges == 2
    finally:
        dg.close()


def _launcher(kind):
    if kind == "numba":
        return launch.Launcher(None, numba_cuda)
    return launch.Launcher(launch.PreparedKernels(cupy, (9, 0), fake_cuda.prepared_source),
                           numba_cuda)


def _logical(rank, n, dtype, seed):
    if dtype == "bfloat16":
        return reference.f32_to_bf16(_host(rank, n, np.float32, seed))
    if dtype == "bool":
        return _host(rank, n, np.int32, seed) % 2 == 1
    return _host(rank, n, dtype, seed)


@pytest.mark.parametrize("force", [None, Transport.CUDA_AWARE_MPI], ids=["chosen", "cuda-aware"])
@pytest.mark.parametrize(("dtype", "op", "pre", "post"), [
    ("float32", ReduceOp.SUM, 0.5, 2.0), ("float16", ReduceOp.SUM, 1.0, 0.25),
    ("bfloat16", ReduceOp.MAX, 1.0, 1.0), ("int32", ReduceOp.PRODUCT, 1.0, 1.0),
    ("float64", ReduceOp.MIN, 1.0, 3.0), ("bool", ReduceOp.SUM, 1.0, 1.0)])
def test_prepared_launches_give_numba_dispatchs_bits(hvd, force, dtype, op, pre, post):
    """The kernels launched as prepared RawKernels (arguments laid out by hand as numba's ABI
    lays them out, decoded by the fake) give the same bits as numba's own dispatch, and the
    reference's values, on two channels."""
    sizes = (130, 7, 301)
    results = {}
    for kind in ("numba", "prepared"):
        dg = DeviceGroup(_device_group(hvd, allreduce_streams=2),
                         cuda_aware=force == Transport.CUDA_AWARE_MPI, force=force,
                         launcher=_launcher(kind))
        try:
            xs = [cupy.asarray(_logical(RANK, n, dtype, seed=i)) for i, n in enumerate(sizes)]
            stream = cupy.cuda.get_current_stream()
            dg.allreduce(xs, xs, Reduction(dtype, pre, post, op), [], [stream])
            results[kind] = [np.asarray(x).copy() for x in xs]
        finally:
            dg.close()
    for i, n in enumerate(sizes):
        got, other = results["prepared"][i], results["numba"][i]
        np.testing.assert_array_equal(got.view(np.uint8), other.view(np.uint8))
        want = reference.reduce([_logical(r, n, dtype, seed=i) for r in range(SIZE)], dtype, op,
                                pre, post)
        if dtype == "bfloat16":
            np.testing.assert_allclose(reference.bf16_to_f32(got), reference.bf16_to_f32(want),
                                       rtol=1e-2)
        else:
            _close(got, want)


def test_broadcast_and_allgather_of_device_arrays_are_staged(hvd):
    x = cupy.asarray(np.full(6, float(RANK), np.float32))
    b = hvd.broadcast(x, root_rank=SIZE - 1, name="dev.bcast")
    assert isinstance(b, cupy.ndarray) and (np.asarray(b) == SIZE - 1).all()
    g = hvd.allgather(cupy.asarray(np.full((RANK + 1, 2), RANK, np.int64)), name="dev.gather")
    assert isinstance(g, cupy.ndarray)
    want = np.concatenate([np.full((r + 1, 2), r, np.int64) for r in range(SIZE)])
    np.testing.assert_array_equal(np.asarray(g), want)


def test_joined_ranks_contribute_zeros_from_the_device_path(hvd):
    if RANK == 0:
        x = cupy.asarray(np.full(10, 3.0, np.float32))
        out = hvd.allreduce(x, op=hvd.Sum, name="after.join")
        np.testing.assert_array_equal(np.asarray(out), 3.0)
    assert hvd.join() in range(SIZE)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_adasum_of_device_arrays_is_staged_through_the_host(hvd, dtype):
    """No device kernels for Adasum: device tensors are reduced on host copies (Horovod without
    NCCL does the same); each tensor of a grouped call keeps its own dot products."""
    name = np.dtype(dtype).name
    sizes = [7, 300]
    xs = [cupy.asarray(_host(RANK, n, dtype, seed=10 + i) - 1.5) for i, n in enumerate(sizes)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Adasum, name=f"dev.adasum.{name}")
    inputs = [[(_host(r, n, dtype, seed=10 + i) - 1.5).astype(dtype) for i, n in
               enumerate(sizes)] for r in range(SIZE)]
    for out, want in zip(outs, reference.adasum(inputs, name)):
        assert isinstance(out, cupy.ndarray) and out.dtype == np.dtype(dtype)
        tol = 2**-9 if dtype == np.float16 else 1e-5
        np.testing.assert_allclose(np.asarray(out, np.float64), want.astype(np.float64),
                                   rtol=0, atol=tol * np.abs(want).max())


def _mixed(rank, n, dtype, seed):
    """Magnitudes over six decades, so that the order of additions shows in the bits."""
    gen = np.random.default_rng([rank, n, seed])
    data = (gen.normal(size=n) * 10.0 ** gen.integers(-3, 3, n)).astype(np.float32)
    return reference.f32_to_bf16(data) if dtype == "bfloat16" else data.astype(dtype)


# Every transport and two channels in float32; each other type once, on the topology's own
# transport (the simulator runs one Python thread per CUDA thread: keep the matrix small).
# rank-order stages every float bucket through the host whatever is forced.
DETERMINISTIC_CASES = [("float32", None, 1), ("float32", None, 2),
                       ("float32", Transport.HOST_STAGING, 2),
                       ("float32", Transport.CUDA_AWARE_MPI, 1),
                       ("float16", None, 1), ("bfloat16", None, 1), ("float64", None, 1)]


@pytest.mark.parametrize("mode", ["rank-order", "fixed-point"])
@pytest.mark.parametrize(("dtype", "force", "streams_"), DETERMINISTIC_CASES)
def test_deterministic_device_sums_give_the_cpu_bits(hvd, mode, dtype, force, streams_):
    """MPITRAIN_DETERMINISTIC on CUDA buffers: whatever the transport (IPC within the node and
    around the cross-node step, CUDA-aware MPI, host staging), one or two channels and however
    the bucket is packed, every rank gets the bits of the design's numpy statement, which the
    CPU data plane gives too (tests/mpi/test_deterministic.py)."""
    from mpitrain.ops import fixed_point

    sizes = [1, 60, 85]  # 146 elements, more than two chunks of 256 B: both channels carry data
    pre, post = (0.5, 1.0 / SIZE) if dtype != "float64" else (1.0, 3.0)
    inputs = [[_mixed(r, n, dtype, seed=i) for i, n in enumerate(sizes)] for r in range(SIZE)]
    want = [fixed_point.reference([inputs[r][i] for r in range(SIZE)], dtype, pre, post)
            if mode == "fixed-point" else
            reference.reduce([inputs[r][i] for r in range(SIZE)], dtype, ReduceOp.SUM, pre, post)
            for i in range(len(sizes))]
    dg = DeviceGroup(_device_group(hvd, allreduce_streams=streams_, deterministic=mode),
                     cuda_aware=force == Transport.CUDA_AWARE_MPI, force=force)
    try:
        xs = [cupy.asarray(x) for x in inputs[RANK]]
        outs = [cupy.asarray(np.zeros_like(x)) for x in inputs[RANK]]
        stream = cupy.cuda.get_current_stream()
        how = Reduction(dtype, pre, post, ReduceOp.SUM)
        dg.allreduce(xs, outs, how, [], [stream])  # packed
        dg.allreduce(xs[2:], xs[2:], how, [], [stream])  # in place
        stream.synchronize()
    finally:
        dg.close()
    for out, w in zip(outs, want):
        assert np.asarray(out).tobytes() == w.tobytes()
    assert np.asarray(xs[2]).tobytes() == want[2].tobytes()


@pytest.mark.parametrize("mode", ["rank-order", "fixed-point"])
def test_deterministic_device_min_max_product_fold_in_rank_order(hvd, mode):
    dg = DeviceGroup(_device_group(hvd, deterministic=mode), cuda_aware=False)
    try:
        for op in (ReduceOp.MAX, ReduceOp.PRODUCT):
            inputs = [[_mixed(r, n, "float32", seed=i) for i, n in enumerate([5, 90])]
                      for r in range(SIZE)]
            xs = [cupy.asarray(x) for x in inputs[RANK]]
            stream = cupy.cuda.get_current_stream()
            dg.allreduce(xs, xs, Reduction("float32", 0.5, 3.0, op), [], [stream])
            stream.synchronize()
            for i, x in enumerate(xs):
                want = reference.reduce([inputs[r][i] for r in range(SIZE)], "float32", op,
                                        0.5, 3.0)
                assert np.asarray(x).tobytes() == want.tobytes(), (op, i)
    finally:
        dg.close()
