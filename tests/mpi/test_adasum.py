"""op=Adasum through the public API and the data plane, against the numpy reference.

Every rank can build every rank's inputs (they are seeded by rank), so each rank computes the
reference tree (:func:`mpitrain.ops.reference.adasum`) itself and checks its own result, which
must also be the same bits on every rank.  At 3 ranks only the clear error is checked.
"""

import dataclasses
import zlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpitrain import ops
from mpitrain.core import config as config_mod
from mpitrain.core import topology
from mpitrain.core.dtypes import ReduceOp
from mpitrain.ops import reference
from mpitrain.ops.group import Group

# Four ranks run as 2x2 (flat Adasum over all four, and the hierarchical form): np4 would
# repeat the flat half on the same code.
MPI_CONFIGS = ("np1", "np2", "2x2", "np3")
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.world_sizes(1, 2, 4)

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
         "float64": torch.float64}
# Agreement with the reference: float64 to 1e-12, float32 to a few ulps (dot products summed
# in another order move a coefficient in its last bits); 16-bit types to one rounding of the
# float32 result.
ULPS = {"float64": 1e-12, "float32": 4 * 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def rank_tensor(rank: int, n: int, seed: int, dtype: str = "float32") -> torch.Tensor:
    gen = np.random.default_rng(1000 * seed + rank)
    data = gen.normal(size=n) * (1.0 + rank)  # different norms per rank
    return torch.from_numpy(data).to(TORCH[dtype])


def storage(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def expected(counts, seeds, dtype="float32", pre=1.0, post=1.0, local_size=1):
    inputs = [[storage(rank_tensor(r, n, s, dtype)) for n, s in zip(counts, seeds)]
              for r in range(SIZE)]
    return reference.adasum(inputs, dtype, pre, post, local_size)


def check(got: torch.Tensor, want: np.ndarray, dtype: str = "float32") -> None:
    got64 = got.to(torch.float64).numpy().reshape(-1)
    want64 = (reference.widen(want, dtype) if dtype != "float64" else want).astype(np.float64)
    scale = max(float(np.abs(want64).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(got64, want64.reshape(-1), rtol=0, atol=ULPS[dtype] * scale)
    digest = zlib.crc32(storage(got.contiguous()).tobytes())
    assert len(set(WORLD.allgather(digest))) == 1, "ranks disagree on the result"


# ------------------------------------------------------------------------ allreduce
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_allreduce_matches_the_reference(hvd, dtype):
    t = rank_tensor(RANK, 1001, seed=1, dtype=dtype)
    out = hvd.allreduce(t, op=hvd.Adasum, name=f"adasum.{dtype}")
    assert out.dtype == t.dtype and out.shape == t.shape
    check(out, expected([1001], [1], dtype)[0], dtype)


def test_every_allreduce_form(hvd):
    want = expected([257], [2])[0]
    check(hvd.allreduce(rank_tensor(RANK, 257, 2), op=hvd.Adasum), want)
    t = rank_tensor(RANK, 257, 2)
    assert hvd.allreduce_(t, op=hvd.Adasum) is t
    check(t, want)
    check(hvd.synchronize(hvd.allreduce_async(rank_tensor(RANK, 257, 2), op=hvd.Adasum)), want)
    t = rank_tensor(RANK, 257, 2)
    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Adasum))
    check(t, want)
    a = np.ascontiguousarray(rank_tensor(RANK, 257, 2).numpy())  # numpy arrays too
    check(torch.from_numpy(hvd.allreduce(a, op=hvd.Adasum)), want)


def test_scale_factors(hvd):
    t = rank_tensor(RANK, 300, seed=3)
    out = hvd.allreduce(t, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0)
    check(out, expected([300], [3], pre=0.5, post=3.0)[0])


def test_grouped_tensors_keep_their_own_dot_products(hvd):
    counts, seeds = [5, 0, 1000, 33, 1], [10, 11, 12, 13, 14]
    want = expected(counts, seeds)
    executor = hvd.session.engine().process_set(0).executor
    before = executor.fused_tensors
    outs = hvd.grouped_allreduce([rank_tensor(RANK, n, s) for n, s in zip(counts, seeds)],
                                 op=hvd.Adasum)
    assert executor.fused_tensors == before + len(counts)  # one packed bucket
    for got, w in zip(outs, want):
        check(got, w)
    ts = [rank_tensor(RANK, n, s) for n, s in zip(counts, seeds)]
    hvd.grouped_allreduce_(ts, op=hvd.Adasum)
    for got, w in zip(ts, want):
        check(got, w)


def test_requests_in_flight_together_keep_their_own_dot_products(hvd):
    counts, seeds = [64, 7, 300, 1, 129, 2000], [20, 21, 22, 23, 24, 25]
    want = expected(counts, seeds)
    ts = [rank_tensor(RANK, n, s) for n, s in zip(counts, seeds)]
    handles = [hvd.allreduce_async_(t, op=hvd.Adasum, name=f"fuse.{i}") for i, t in
               enumerate(ts)]
    for h in handles:
        hvd.synchronize(h)
    for got, w in zip(ts, want):
        check(got, w)


def test_parallel_gradients_average_and_orthogonal_ones_add(hvd):
    direction = rank_tensor(0, 64, seed=30, dtype="float64")
    out = hvd.allreduce(direction * (RANK + 1), op=hvd.Adasum)
    mean = sum(range(1, SIZE + 1)) / SIZE
    np.testing.assert_allclose(out.numpy(), (direction * mean).numpy(), rtol=1e-12)
    basis = torch.eye(max(SIZE, 1), dtype=torch.float64)
    out = hvd.allreduce(basis[RANK].clone(), op=hvd.Adasum)
    np.testing.assert_array_equal(out.numpy(), np.ones(SIZE))


def test_reducescatter_keeps_this_ranks_block(hvd):
    t = rank_tensor(RANK, 4 * 7 + 3, seed=40).reshape(-1, 1)  # rows not divisible by SIZE
    out = hvd.reducescatter(t, op=hvd.Adasum)
    rows = [len(b) for b in np.array_split(np.arange(t.shape[0]), SIZE)]
    want = expected([t.numel()], [40])[0]
    start = sum(rows[:RANK])
    np.testing.assert_allclose(out.reshape(-1).numpy(), want[start:start + rows[RANK]],
                               rtol=0, atol=ULPS["float32"] * np.abs(want).max())
    outs = hvd.grouped_reducescatter([t, t * 2], op=hvd.Adasum)
    np.testing.assert_allclose(outs[1].numpy(), 2 * outs[0].numpy(), rtol=1e-6)


@pytest.mark.world_sizes(2, 4)
def test_a_joined_rank_contributes_nothing(hvd):
    if RANK == 0:
        t = rank_tensor(0, 50, seed=50)
        out = hvd.allreduce(t, op=hvd.Adasum, name="adasum.after.join")
        np.testing.assert_array_equal(out.numpy(), t.numpy())  # Adasum(a, 0) = a
    assert hvd.join() in range(SIZE)


def test_integer_tensors_are_refused(hvd):
    with pytest.raises(TypeError, match="Adasum needs floating-point tensors.*int64"):
        hvd.allreduce(torch.ones(3, dtype=torch.int64), op=hvd.Adasum)


# ------------------------------------------------------------------ hierarchical form
@pytest.fixture(scope="module")
def hier_group():
    """A data-plane group of its own (like the engine's), configured for the hierarchical form."""
    cfg = dataclasses.replace(config_mod.load(), adasum_hierarchical=True)
    topo, comms = topology.build(WORLD.Dup(), cfg.local_size)
    g = Group(comms, topo, cfg)
    yield g
    g.close()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_hierarchical_averages_within_nodes_then_adasum_across(hier_group, dtype):
    counts, seeds = [3, 1000, 17], [60, 61, 62]
    send = np.concatenate([storage(rank_tensor(RANK, n, s, dtype)) for n, s in
                           zip(counts, seeds)])
    recv = np.empty_like(send)
    ops.allreduce(hier_group, send, recv, ops.Reduction(dtype, op=ReduceOp.ADASUM), counts=counts)
    topo = hier_group.topology
    want = np.concatenate(expected(counts, seeds, dtype, local_size=topo.local_size))
    got = torch.from_numpy(recv)
    check(got.view(torch.bfloat16) if dtype == "bfloat16" else got, want, dtype)
    if topo.local_size > 1 and topo.num_nodes > 1:  # it differs from the flat form here
        flat = np.concatenate(expected(counts, seeds, "float64"))
        assert np.abs(flat - reference.widen(want, dtype)).max() > 1e-2


def test_hierarchical_in_place_with_scale_factors(hier_group):
    x = storage(rank_tensor(RANK, 99, seed=63)).copy()
    ops.allreduce(hier_group, x, x, ops.Reduction("float32", 2.0, 0.25, ReduceOp.ADASUM))
    want = expected([99], [63], pre=2.0, post=0.25,
                    local_size=hier_group.topology.local_size)[0]
    check(torch.from_numpy(x), want)


# ------------------------------------------------------------------ DistributedOptimizer
def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)


def _local_update(model, opt, rank, step):
    """What one rank's plain optimizer would do to ``model`` (a copy) on its own batch."""
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    return [p.detach() - b for p, b in zip(model.parameters(), before)]


def test_optimizer_steps_locally_then_adasums_the_updates(hvd):
    from mpitrain.torch.adasum_optimizer import AdasumOptimizer

    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    assert isinstance(opt, torch.optim.SGD)
    assert isinstance(opt, AdasumOptimizer) == (SIZE > 1)  # Horovod: plain at size 1
    # Every rank replays every rank's local optimizer (same start, own batches).
    replicas = [_model() for _ in range(SIZE)]
    plain = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
    for step in range(3):
        x, y = _batch(RANK, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        updates = [_local_update(replicas[r], plain[r], r, step) for r in range(SIZE)]
        combined = reference.adasum([[u.numpy() for u in us] for us in updates], "float32")
        for r in range(SIZE):  # every replica continues from the combined result
            with torch.no_grad():
                for p, u, c in zip(replicas[r].parameters(), updates[r], combined):
                    p.add_(torch.from_numpy(c) - u)
        for p, q in zip(model.parameters(), replicas[0].parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=0,
                                       atol=1e-5)
    digest = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    assert len(set(WORLD.allgather(digest))) == 1


@pytest.mark.world_sizes(2, 4)
def test_optimizer_usage_rules(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   backward_passes_per_step=2)
    x, y = _batch(RANK, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="Skipping synchronization"), \
            opt.skip_synchronize():
        pass
    opt.synchronize()  # nothing to do, as in Horovod
    opt.step()
    opt.zero_grad()
    digest = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    assert len(set(WORLD.allgather(digest))) == 1


@pytest.mark.world_sizes(2, 4)
def test_optimizer_with_a_parameter_unused_on_some_ranks(hvd):
    model = _model()
    extra = torch.nn.Parameter(torch.ones(3))
    params = [*model.named_parameters(), ("extra", extra)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params, op=hvd.Adasum,
                                   compression=hvd.Compression.fp16)
    x, y = _batch(RANK, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if RANK == 0:
        loss = loss + extra.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    # Only rank 0 moved ``extra`` (by -0.1 each); the others' zero updates leave that alone.
    np.testing.assert_allclose(extra.detach().numpy(), 0.9, rtol=1e-3)


# ------------------------------------------------------------------------ 3 ranks
@pytest.mark.world_sizes(3)
def test_three_ranks_is_a_clear_error(hvd):
    for call in (lambda: hvd.allreduce(torch.ones(4), op=hvd.Adasum),
                 lambda: hvd.allreduce_async_(torch.ones(4), op=hvd.Adasum),
                 lambda: hvd.grouped_allreduce([torch.ones(4)], op=hvd.Adasum),
                 lambda: hvd.reducescatter(torch.ones(6), op=hvd.Adasum)):
        with pytest.raises(ValueError, match="power-of-two number of ranks.*has 3"):
            call()
    model = _model()
    with pytest.raises(NotImplementedError, match="has 3"):  # Horovod's exception type
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [3.0, 3.0]  # nothing stuck
