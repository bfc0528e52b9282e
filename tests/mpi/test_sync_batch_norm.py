"""SyncBatchNorm equals torch.nn.BatchNorm on the concatenated batch of its scope.

Every rank builds every rank's share of a global batch from seeded generators, so each can
compute the reference (plain BatchNorm over the scope's concatenated batch) locally.  Compared:
forward output, input gradient, weight/bias gradients (summed over the scope, which is what
data-parallel reduction does with them), running statistics; for 1d/2d/3d inputs, even and
uneven batches, and a rank with an empty batch; global scope and local scope (the emulated 2x2
topology gives two nodes of two ranks).
"""

import os

import pytest
import torch
from mpi4py import MPI

import mpitrain
from mpitrain import session
from mpitrain.core import runtime
from mpitrain.face.scopes import local_process_set

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "2x2")

C = 3
SHAPES = {"1d": (C,), "1d_len": (C, 5), "2d": (C, 4, 3), "3d": (C, 2, 3, 2)}
BATCHES = {"even": [4, 4, 4, 4], "uneven": [5, 2, 3, 1], "empty": [3, 0, 4, 0]}
REFERENCE = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm2d,
             4: torch.nn.BatchNorm3d}


def scope_ranks(scope: str) -> list[int]:
    if scope == "global":
        return list(range(SIZE))
    topo = runtime.state().topology
    return topo.node_ranks(topo.node_index)


def batch(rank: int, sizes: list[int], shape: tuple[int, ...], step: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s input and upstream gradient at ``step`` (recomputable anywhere)."""
    gen = torch.Generator().manual_seed(7919 * rank + 31 * step + 1)
    n = sizes[rank % len(sizes)]
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64) * 3 + 10
    g = torch.randn((n, *shape), generator=gen, dtype=torch.float64)
    return x.to(dtype), g.to(dtype)


def set_collectives(process_set: mpitrain.ProcessSet) -> int:
    set_id = process_set.process_set_id or 0
    executor = session.engine().process_set(set_id).executor
    return executor.collectives


def tolerances(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9,
                                                                        "atol": 1e-10}


def sum_over(tensor: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    everyone = WORLD.allgather(tensor.detach().numpy())
    return sum(torch.from_numpy(everyone[r]) for r in ranks)


@pytest.mark.parametrize("scope", ["global", "local"])
@pytest.mark.parametrize("sizes", list(BATCHES), ids=str)
@pytest.mark.parametrize("kind", list(SHAPES))
def test_matches_batchnorm_on_concatenated_batch(hvd, scope, sizes, kind):
    dtype = torch.float32
    shape = SHAPES[kind]
    ranks = scope_ranks(scope)
    sbn = hvd.SyncBatchNorm(C, momentum=0.3, comm_scope=scope)
    ref = REFERENCE[len(shape)](C, momentum=0.3)
    with torch.no_grad():
        for m in (sbn, ref):
            m.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
            m.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
    tol = tolerances(dtype)
    for step in range(2):
        x, g = batch(RANK, BATCHES[sizes], shape, step, dtype)
        x.requires_grad_(True)
        sbn.zero_grad()
        out = sbn(x)
        (out * g).sum().backward()

        parts = [batch(r, BATCHES[sizes], shape, step, dtype) for r in ranks]
        xs = torch.cat([p[0] for p in parts]).requires_grad_(True)
        ref.zero_grad()
        ref_out = ref(xs)
        (ref_out * torch.cat([p[1] for p in parts])).sum().backward()
        offset = sum(BATCHES[sizes][r % len(BATCHES[sizes])] for r in ranks
                     if r < RANK)
        mine = slice(offset, offset + x.shape[0])

        torch.testing.assert_close(out, ref_out[mine].detach(), **tol)
        torch.testing.assert_close(x.grad, xs.grad[mine], **tol)
        torch.testing.assert_close(sum_over(sbn.weight.grad, ranks), ref.weight.grad, **tol)
        torch.testing.assert_close(sum_over(sbn.bias.grad, ranks), ref.bias.grad, **tol)
        torch.testing.assert_close(sbn.running_mean, ref.running_mean, **tol)
        torch.testing.assert_close(sbn.running_var, ref.running_var, **tol)
    assert int(sbn.num_batches_tracked) == 2


def test_float64_and_cumulative_momentum(hvd):
    dtype, shape, sizes = torch.float64, SHAPES["2d"], BATCHES["uneven"]
    sbn = hvd.SyncBatchNorm(C, momentum=None).double()
    ref = torch.nn.BatchNorm2d(C, momentum=None).double()
    for step in range(3):
        x, g = batch(RANK, sizes, shape, step, dtype)
        x.requires_grad_(True)
        (sbn(x) * g).sum().backward()
        parts = [batch(r, sizes, shape, step, dtype) for r in range(SIZE)]
        xs = torch.cat([p[0] for p in parts])
        ref(xs)
    tol = tolerances(dtype)
    torch.testing.assert_close(sbn.running_mean, ref.running_mean, **tol)
    torch.testing.assert_close(sbn.running_var, ref.running_var, **tol)


def test_large_mean_is_numerically_stable(hvd):
    """mean/std = 1e4: a float32 sum of squares would lose every digit of the variance."""
    gen = torch.Generator().manual_seed(RANK)
    x = (torch.randn(64, C, generator=gen, dtype=torch.float64) + 1e4).float()
    sbn = hvd.SyncBatchNorm(C, affine=False, momentum=1.0)
    sbn(x)
    xs = torch.cat(WORLD.allgather(x))
    want = xs.double().var(dim=0, unbiased=True)
    torch.testing.assert_close(sbn.running_var.double(), want, rtol=1e-3, atol=0)


@pytest.mark.parametrize("scope", ["global", "local"])
def test_one_exchange_per_forward_and_backward(hvd, scope):
    sbn = hvd.SyncBatchNorm(C, comm_scope=scope)
    x = torch.randn(4, C, 2, 2, requires_grad=True)
    sbn(x).sum().backward()  # registers the local sets on first use
    process_set = local_process_set() if scope == "local" else hvd.global_process_set
    before = set_collectives(process_set)
    out = sbn(x)
    after_forward = set_collectives(process_set)
    out.sum().backward()
    after_backward = set_collectives(process_set)
    assert (after_forward - before, after_backward - after_forward) == (1, 1)


def test_eval_mode_uses_running_stats_without_communication(hvd):
    sbn = hvd.SyncBatchNorm(C, comm_scope="global")
    with torch.no_grad():
        sbn.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0]))
        sbn.running_var.copy_(torch.tensor([4.0, 0.25, 1.0]))
    sbn.eval()
    before = set_collectives(hvd.global_process_set)
    # Different batch sizes and an empty batch on some ranks: no rank waits for another.
    x = torch.randn(RANK % 2 * 3, C, 5)
    out = sbn(x)
    assert set_collectives(hvd.global_process_set) == before
    want = torch.nn.functional.batch_norm(x, sbn.running_mean, sbn.running_var, sbn.weight,
                                          sbn.bias, False, 0.0, sbn.eps)
    torch.testing.assert_close(out, want)


def test_too_few_values_raise_on_every_rank(hvd):
    sbn = hvd.SyncBatchNorm(C)
    x = torch.randn(1 if RANK == 0 else 0, C)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sbn(x)


def test_convert_sync_batchnorm_shares_parameters(hvd):
    model = torch.nn.Sequential(torch.nn.Conv2d(2, C, 1), torch.nn.BatchNorm2d(C),
                                torch.nn.Sequential(torch.nn.BatchNorm2d(C)))
    weight = model[1].weight
    running = model[1].running_mean
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model, comm_scope=0)
    assert isinstance(converted[1], hvd.SyncBatchNorm)
    assert isinstance(converted[2][0], hvd.SyncBatchNorm)
    assert converted[1].weight is weight and converted[1].running_mean is running
    assert converted[1].comm_scope == 0
    single = hvd.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm1d(4))
    assert isinstance(single, hvd.SyncBatchNorm) and single.comm_scope == "global"


def test_bad_scopes_are_rejected(hvd):
    with pytest.raises(ValueError, match="nodes"):
        hvd.SyncBatchNorm(C, comm_scope="nodes")
    with pytest.raises(ValueError, match="7"):
        hvd.SyncBatchNorm(C, comm_scope=7)
    with pytest.raises(TypeError, match="got True"):
        hvd.SyncBatchNorm(C, comm_scope=True)
    with pytest.raises(ValueError, match="1D"):
        hvd.SyncBatchNorm(C)(torch.randn(C))


def test_process_set_scope(hvd):
    ranks = [0, SIZE - 1]
    ps = hvd.add_process_set(ranks)
    try:
        if RANK in ranks:
            sbn = hvd.SyncBatchNorm(C, process_set=ps, momentum=1.0)
            x, _ = batch(RANK, BATCHES["uneven"], SHAPES["1d"], 0, torch.float64)
            sbn.double()(x)
            xs = torch.cat([batch(r, BATCHES["uneven"], SHAPES["1d"], 0, torch.float64)[0]
                            for r in ranks])
            torch.testing.assert_close(sbn.running_mean, xs.mean(0))
    finally:
        hvd.remove_process_set(ps)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("MPITRAIN_TEST_REQUIRE_GPU") != "1",
    reason="needs a CUDA device (MPITRAIN_TEST_REQUIRE_GPU=1 turns this skip into a failure)")


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_match_the_cpu_reference(hvd):
    shape, sizes = SHAPES["2d"], BATCHES["empty"]
    sbn = hvd.SyncBatchNorm(C, momentum=0.3).cuda()
    ref = torch.nn.BatchNorm2d(C, momentum=0.3)
    x, g = batch(RANK, sizes, shape, 0, torch.float32)
    xc = x.cuda().requires_grad_(True)
    out = sbn(xc)
    (out * g.cuda()).sum().backward()
    parts = [batch(r, sizes, shape, 0, torch.float32) for r in range(SIZE)]
    xs = torch.cat([p[0] for p in parts]).requires_grad_(True)
    (ref(xs) * torch.cat([p[1] for p in parts])).sum().backward()
    offset = sum(sizes[r] for r in range(RANK))
    mine = slice(offset, offset + x.shape[0])
    tol = tolerances(torch.float32)
    torch.testing.assert_close(xc.grad.cpu(), xs.grad[mine], **tol)
    torch.testing.assert_close(sbn.running_var.cpu(), ref.running_var, **tol)
