"""mpitrain.torch.nn.parallel.DistributedDataParallel trains step for step like stock torch DDP
over Gloo on the same data, in the same job.

The Gloo group is set up the way a user of mpirun would: rank and size from MPI, and a free TCP
port on localhost found by rank 0 and broadcast to the others.
"""

import os
import warnings

import pytest
import torch
from ddp_common import gloo_world, make_model, train_lockstep
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mpitrain import session
from mpitrain.torch.nn.parallel import DistributedDataParallel as DDP

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "np4")


@pytest.fixture(scope="module")
def gloo(hvd):
    yield from gloo_world()


def assert_same_on_every_rank(module: torch.nn.Module) -> None:
    mine = [p.detach().numpy().tobytes() for p in module.parameters()]
    assert WORLD.allgather(mine) == [mine] * SIZE


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0005], ids=["one_bucket", "many_buckets"])
def test_equals_torch_ddp_over_gloo(gloo, bucket_cap_mb):
    a = DDP(make_model(seed=RANK), bucket_cap_mb=bucket_cap_mb)
    b = TorchDDP(make_model(seed=RANK), process_group=gloo, bucket_cap_mb=bucket_cap_mb)
    train_lockstep(a, b, RANK, steps=4)
    assert_same_on_every_rank(a.module)
    if bucket_cap_mb < 1:
        assert len(a.reducer.buckets) > 1


def test_find_unused_parameters(gloo):
    a = DDP(make_model(seed=RANK), find_unused_parameters=True)
    b = TorchDDP(make_model(seed=RANK), process_group=gloo, find_unused_parameters=True)
    train_lockstep(a, b, RANK, steps=4, skip_odd=True)
    assert_same_on_every_rank(a.module)


def test_unused_parameter_used_on_one_rank_only(gloo):
    """Locally unused but used elsewhere: the reduction still covers it (average with 0)."""
    a = DDP(make_model(seed=RANK), find_unused_parameters=True)
    x = torch.randn(4, 2, 4, 4)
    a(x, skip=RANK != 0).sum().backward()
    grad = a.module.unused.weight.grad
    assert grad is not None
    grads = WORLD.allgather(grad.numpy().tobytes())
    assert grads == [grads[0]] * SIZE and grad.abs().sum() > 0


def test_unused_parameter_without_the_flag_errors_without_hanging(gloo):
    a = DDP(make_model(seed=RANK))
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        a(torch.randn(4, 2, 4, 4), skip=True).sum().backward()
    # Every rank completed the reduction: the wrapper is usable again.
    a(torch.randn(4, 2, 4, 4)).sum().backward()


def test_no_sync_accumulation(gloo):
    a = DDP(make_model(seed=RANK))
    b = TorchDDP(make_model(seed=RANK), process_group=gloo)
    train_lockstep(a, b, RANK, steps=2, accumulate=3, no_sync=True)
    assert_same_on_every_rank(a.module)


def test_gradient_as_bucket_view(gloo):
    a = DDP(make_model(seed=RANK), gradient_as_bucket_view=True, bucket_cap_mb=0.001)
    b = TorchDDP(make_model(seed=RANK), process_group=gloo, gradient_as_bucket_view=True,
                 bucket_cap_mb=0.001)
    train_lockstep(a, b, RANK, steps=3)
    views = {v.data_ptr() for bucket in a.reducer.buckets for v in bucket.views}
    assert all(p.grad.data_ptr() in views for p in a.module.parameters())


@pytest.mark.parametrize("kwargs", [{"broadcast_buffers": False},
                                    {"forward_sync_buffers": False}], ids=str)
def test_buffer_sync_off(gloo, kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames broadcast_buffers
        b = TorchDDP(make_model(seed=RANK), process_group=gloo, **kwargs)
    a = DDP(make_model(seed=RANK), **kwargs)
    train_lockstep(a, b, RANK, steps=3)
    means = WORLD.allgather(a.module.bn.running_mean.numpy().tobytes())
    assert SIZE == 1 or len(set(means)) > 1  # buffers stayed per-rank


def test_buckets_are_reduced_during_backward(hvd):
    """Overlap: all but the buckets still open at the end went out from gradient hooks."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    a = DDP(model, bucket_cap_mb=0.01)
    engine = session.engine()
    before = engine.stats()["collectives"]
    a(torch.randn(8, 64)).sum().backward()
    assert len(a.reducer.buckets) >= 6
    assert a.reducer.submitted_in_backward == len(a.reducer.buckets)
    assert engine.stats()["collectives"] > before


def test_shape_mismatch_names_parameter_and_ranks(hvd):
    width = 5 if RANK == SIZE - 1 else 4
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, width))
    with pytest.raises(ValueError, match=rf"rank 0 has '1.weight' of shape \(4, 4\).*rank "
                                         rf"{SIZE - 1} has '1.weight' of shape \(5, 4\)"):
        DDP(model)


def test_bad_arguments(hvd):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="ProcessSet"):
        DDP(model, process_group=object())
    with pytest.raises(ValueError, match="device_ids"):
        DDP(model, device_ids=[0])
    with pytest.raises(ValueError, match="mixed_precision"):
        DDP(model, mixed_precision=object())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("MPITRAIN_TEST_REQUIRE_GPU") != "1",
    reason="needs a CUDA device (MPITRAIN_TEST_REQUIRE_GPU=1 turns this skip into a failure)")
def test_cuda_module_reduces_like_a_cpu_one(hvd):
    gpu = DDP(make_model(seed=RANK).cuda(), device_ids=[0], bucket_cap_mb=0.001)
    cpu = DDP(make_model(seed=RANK), bucket_cap_mb=0.001)
    x, y = torch.randn(4, 2, 4, 4), torch.randint(0, 3, (4,))
    torch.nn.functional.cross_entropy(gpu(x.cuda()), y.cuda()).backward()
    torch.nn.functional.cross_entropy(cpu(x), y).backward()
    for pg, pc in zip(gpu.module.parameters(), cpu.module.parameters()):
        torch.testing.assert_close(pg.grad.cpu(), pc.grad, rtol=1e-4, atol=1e-5)
