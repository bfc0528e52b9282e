"""Collectives on CUDA tensors and cupy arrays, on a real GPU, against the numpy reference.

Run by tests/test_gpu_suites.py at 1, 2 and 4 ranks sharing the machine's GPU(s), with one
and two streams, through CUDA IPC (one node), host staging, and the hierarchical path (2x2).
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitrain.core.dtypes import ReduceOp
from mpitrain.core.errors import MpitrainInternalError
from mpitrain.ops import reference

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
          "uint8": torch.uint8}
OPS = {"Sum": ReduceOp.SUM, "Average": ReduceOp.AVERAGE, "Min": ReduceOp.MIN,
       "Max": ReduceOp.MAX, "Product": ReduceOp.PRODUCT}
TOL = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-5, "float64": 1e-12}


def _host(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 2 + 0.5).to(dtype)  # positive: Product stays sane
    return torch.randint(0, 7, (n,), generator=g).to(dtype)


def _storage(t):
    t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _expected(n, name, op, pre, post, seed=0):
    dtype = DTYPES[name]
    inputs = [_storage(_host(r, n, dtype, seed)) for r in range(SIZE)]
    if op == ReduceOp.AVERAGE:
        op, post = ReduceOp.SUM, post / SIZE
    return reference.reduce(inputs, name, op, pre, post)


def _check(got, want, name):
    got = _storage(got)
    if name in TOL:
        g = reference.widen(got, name).astype(np.float64)
        w = reference.widen(np.asarray(want), name).astype(np.float64)
        np.testing.assert_allclose(g, w, rtol=TOL[name], atol=TOL[name])
    else:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("op_name", list(OPS))
def test_allreduce_of_cuda_tensors_matches_the_reference(hvd, name, op_name):
    dtype, op = DTYPES[name], OPS[op_name]
    if op == ReduceOp.AVERAGE and not dtype.is_floating_point:
        pytest.skip("Average of integers rounds differently by design")
    n = 4099  # ragged: not a multiple of any vector width
    pre, post = (0.5, 2.0) if dtype.is_floating_point and op in (
        ReduceOp.SUM, ReduceOp.AVERAGE) else (1.0, 1.0)
    x = _host(RANK, n, dtype).cuda()
    out = hvd.allreduce(x, op=op, name=f"ar.{name}.{op_name}", prescale_factor=pre,
                        postscale_factor=post)
    assert out.is_cuda and out.device == x.device and out.dtype == dtype
    _check(out, _expected(n, name, op, pre, post), name)


def test_many_small_tensors_are_fused_into_few_device_collectives(hvd):
    engine = hvd.session.engine()
    before = engine.stats()["collectives"]
    tensors = [_host(RANK, 1 + 37 * i, torch.float32, seed=i).cuda() for i in range(60)]
    handles = [hvd.allreduce_async_(t, name=f"fused.{i}", op=hvd.Sum)
               for i, t in enumerate(tensors)]
    for h in handles:
        hvd.synchronize(h)
    for i, t in enumerate(tensors):
        _check(t, _expected(1 + 37 * i, "float32", ReduceOp.SUM, 1.0, 1.0, seed=i), "float32")
    assert engine.stats()["collectives"] - before < 60


@pytest.mark.parametrize("mib", [1, 64])
def test_large_buckets_cross_channels_and_staging_chunks(hvd, mib):
    n = mib * (1 << 20) // 4 + 3
    x = _host(RANK, n, torch.float32, seed=mib).cuda()
    hvd.allreduce_(x, op=hvd.Average, name=f"large.{mib}")
    _check(x, _expected(n, "float32", ReduceOp.AVERAGE, 1.0, 1.0, seed=mib), "float32")


def test_results_are_ordered_on_a_side_stream_without_host_sync(hvd):
    # The gradient is produced on a side stream; the allreduce must wait for it (submit-time
    # event) and the consumer on that stream must see the result (join event), with no
    # torch.cuda.synchronize() anywhere.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.full((1 << 22,), float(RANK + 1), device="cuda")
        for _ in range(20):  # keep the stream busy so a missing wait would read early
            big = big * 1.0 + 0.0
        handle = hvd.allreduce_async_(big, op=hvd.Sum, name="side.stream")
        hvd.synchronize(handle)
        total = big.sum()  # enqueued on the side stream after the results
    side.synchronize()
    assert total.item() == pytest.approx((1 << 22) * SIZE * (SIZE + 1) / 2)


def test_cupy_arrays_go_through_the_same_api(hvd, cupy):
    x = cupy.full(1000, RANK + 1, dtype=cupy.float32)
    out = hvd.allreduce(x, op=hvd.Sum, name="cupy.sum")
    assert isinstance(out, cupy.ndarray)
    assert float(out[0]) == SIZE * (SIZE + 1) / 2


def test_broadcast_and_allgather_of_cuda_tensors(hvd):
    x = torch.full((5, 3), float(RANK), device="cuda")
    b = hvd.broadcast(x, root_rank=SIZE - 1, name="gpu.bcast")
    assert b.is_cuda and torch.all(b == SIZE - 1)
    g = hvd.allgather(torch.full((RANK + 1, 2), float(RANK), device="cuda"), name="gpu.gather")
    assert g.is_cuda and g.shape == (SIZE * (SIZE + 1) // 2, 2)
    rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(SIZE)])
    assert torch.equal(g.cpu(), rows)


def test_transport_of_this_configuration(hvd):
    executor = hvd.session.engine().process_set(0).executor
    hvd.allreduce(torch.ones(8, device="cuda"), name="transport.probe")
    dg = executor.device._device_group
    assert dg is not None
    topo = hvd.core.runtime.state().topology
    algorithm = hvd.core.runtime.state().config.allreduce_algorithm
    if topo.local_size > 1 and algorithm == "auto":
        assert dg.uses_ipc, dg.phases
    print(f"rank {RANK}: phases {dg.phases}")


@pytest.mark.world_sizes(2, 4)
def test_a_cpu_tensor_on_one_rank_and_cuda_on_others_fails_everywhere(hvd):
    x = torch.ones(4) if RANK == 0 else torch.ones(4, device="cuda")
    with pytest.raises(MpitrainInternalError, match="mismatched device"):
        hvd.allreduce(x, name="mixed.kinds")


def test_a_tensor_on_another_gpu_than_the_bound_one_is_refused(hvd):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    bound = hvd.core.runtime.state().device
    other = (bound + 1) % torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"cuda:{other}, but this rank is bound to cuda:{bound}"):
        hvd.allreduce(torch.ones(4, device=f"cuda:{other}"), name="wrong.device")
