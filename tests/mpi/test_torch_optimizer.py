"""DistributedOptimizer: N steps on p ranks equal one process training on the joined batches.

Every rank also trains the reference locally (no communication) on the concatenation of all
ranks' batches, so each assertion compares against exact single-process training.  Errors are
checked at world size 2.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from mpi4py import MPI

import mpitrain as hvd
from mpitrain.torch.optimizer import OptimizerUsageError

MPI_CONFIGS = ("np1", "np2", "np4")
SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()
PER_RANK = 3
STEPS = 4


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one (step, micro-step): SIZE * PER_RANK rows, same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return (torch.randn(SIZE * PER_RANK, 5, generator=g),
            torch.randn(SIZE * PER_RANK, 3, generator=g))


def _mine(t: torch.Tensor) -> torch.Tensor:
    return t[RANK * PER_RANK:(RANK + 1) * PER_RANK]


def _train(make_opt, distributed: bool, passes: int = 1, loss_scale: float = 1.0):
    model = _model()
    opt = make_opt(model)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(passes):
            x, y = _batch(step, micro)
            if distributed:
                x, y = _mine(x), _mine(y)
            loss = torch.nn.functional.mse_loss(model(x), y) * loss_scale / passes
            loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _assert_same(got, want, tol=1e-5):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


NOT_AT_4 = pytest.mark.world_sizes(1, 2)  # variations: two ranks suffice, CI time is short


@pytest.mark.parametrize("kwargs", [
    pytest.param({}, id="default"),
    pytest.param({"shared_buckets": False}, id="no-buckets"),
    pytest.param({"groups": 2}, id="groups2"),
    pytest.param({"gradient_predivide_factor": 2.0}, id="predivide", marks=NOT_AT_4),
    pytest.param({"compression": hvd.Compression.fp16}, id="fp16", marks=NOT_AT_4),
    pytest.param({"compression": hvd.Compression.bf16}, id="bf16", marks=NOT_AT_4),
])
def test_matches_single_process_on_joined_batches(hvd, kwargs):
    want = _train(_sgd, distributed=False)
    got = _train(lambda m: hvd.DistributedOptimizer(_sgd(m), m.named_parameters(), **kwargs),
                 distributed=True)
    lossy = "compression" in kwargs
    _assert_same(got, want, tol=2e-2 if lossy else 1e-5)


@NOT_AT_4
@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_16_bit_wire_buckets_give_the_per_tensor_compressors_bits(hvd, compression):
    # shared_buckets (the default) casts into 16-bit bucket views reduced in place;
    # shared_buckets=False runs the compressor per tensor and fuses.  The same casts and the
    # same sums: the same bits.
    chosen = getattr(hvd.Compression, compression)
    made = []

    def make(buckets):
        def wrap(m):
            opt = hvd.DistributedOptimizer(_sgd(m), m.named_parameters(), compression=chosen,
                                           shared_buckets=buckets)
            made.append(opt)
            return opt
        return wrap

    in_wire = _train(make(True), distributed=True)
    per_tensor = _train(make(False), distributed=True)
    for a, b in zip(in_wire, per_tensor):
        assert torch.equal(a, b)
    wire_opt = made[0]
    if SIZE > 1:  # every float32 gradient has a 16-bit view; p.grad keeps its own type
        wire_type = torch.float16 if compression == "fp16" else torch.bfloat16
        views = wire_opt._submitter.wire_views
        assert set(views) == {p for g in wire_opt.param_groups for p in g["params"]}
        assert all(v.dtype == wire_type for v in views.values())
        assert all(p.grad.dtype == torch.float32 for p in views)


@pytest.mark.parametrize("passes", [2, pytest.param(3, marks=NOT_AT_4)])
def test_backward_passes_per_step_accumulates(hvd, passes):
    want = _train(_sgd, distributed=False, passes=passes)
    got = _train(lambda m: hvd.DistributedOptimizer(_sgd(m), m.named_parameters(),
                                                    backward_passes_per_step=passes),
                 distributed=True, passes=passes)
    _assert_same(got, want)


@NOT_AT_4
def test_set_backward_passes_per_step(hvd):
    want = _train(_sgd, distributed=False, passes=2)

    def make(m):
        opt = hvd.DistributedOptimizer(_sgd(m), m.named_parameters())
        opt.set_backward_passes_per_step(2)
        return opt

    _assert_same(_train(make, distributed=True, passes=2), want)


def test_sum_op_and_adam_and_explicit_groups(hvd):
    # Sum of the per-rank mean losses = SIZE * the joined mean loss.
    want = _train(lambda m: torch.optim.Adam(m.parameters(), lr=0.01), distributed=False,
                  loss_scale=SIZE)

    def make(m):
        params = list(m.parameters())
        return hvd.DistributedOptimizer(torch.optim.Adam(params, lr=0.01), m.named_parameters(),
                                        op=hvd.Sum, groups=[params[:2], params[3:]])

    _assert_same(_train(make, distributed=True), want, tol=1e-4)


@NOT_AT_4
def test_unnamed_parameters_and_param_groups(hvd):
    def make_plain(m):
        return torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.05},
                                {"params": m[2].parameters()}], lr=0.1)

    want = _train(make_plain, distributed=False)
    got = _train(lambda m: hvd.DistributedOptimizer(make_plain(m)), distributed=True)
    _assert_same(got, want)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 4)
        self.head_a = torch.nn.Linear(4, 2)
        self.head_b = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def test_parameter_without_gradient_on_some_ranks_does_not_hang(hvd):
    """Only rank 0 uses head_b: the others contribute zeros, submitted at step()."""

    def run(distributed: bool):
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, model.named_parameters())
        for step in range(3):
            x, y = _batch(step, 0)
            x, y = x[:, :4], y[:, :2]
            opt.zero_grad()
            if distributed:
                loss = torch.nn.functional.mse_loss(model(_mine(x), RANK == 0), _mine(y))
            else:  # the mean over ranks of each rank's loss
                loss = sum(torch.nn.functional.mse_loss(
                    model(x[r * PER_RANK:(r + 1) * PER_RANK], r == 0),
                    y[r * PER_RANK:(r + 1) * PER_RANK]) for r in range(SIZE)) / SIZE
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    _assert_same(run(True), run(False))


class _Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.out = torch.nn.Linear(4, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx).mean(1))


@pytest.mark.parametrize("sparse_as_dense", [False, pytest.param(True, marks=NOT_AT_4)])
def test_sparse_gradients(hvd, sparse_as_dense):
    def run(distributed: bool):
        model = _Bag()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        if distributed:
            opt = hvd.DistributedOptimizer(opt, model.named_parameters(),
                                           sparse_as_dense=sparse_as_dense)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 20, (SIZE * PER_RANK, 3), generator=g)
            y = torch.randn(SIZE * PER_RANK, 1, generator=g)
            if distributed:
                idx, y = _mine(idx), _mine(y)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(idx), y).backward()
            if distributed and not sparse_as_dense:
                assert model.emb.weight.grad.is_sparse
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    _assert_same(run(True), run(False))


@NOT_AT_4
def test_synchronize_then_clip_then_step_in_skip_synchronize(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), model.named_parameters())
    x, y = _batch(0, 0)
    torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    grads = [p.grad.clone() for p in model.parameters()]
    everyone = hvd.allgather_object(grads)
    for other in everyone:
        _assert_same(other, grads, tol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.world_sizes(2, 4)
def test_shared_buckets_reduce_without_copies(hvd):
    """One group: its gradients lie back to back in one bucket, so the grouped request is
    reduced where it lies, every step; zero_grad() keeps torch's meaning."""
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), model.named_parameters(), groups=1)
    engine = hvd.session.engine()
    views = {id(p): v for p, v in opt._submitter.views.items()}
    for step in range(3):
        x, y = _batch(step, 0)
        opt.zero_grad(set_to_none=step != 1)
        if step != 1:
            assert all(p.grad is None for p in model.parameters())
        before = engine.stats()["zero_copy_buckets"]
        torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
        opt.step()
        assert all(p.grad.data_ptr() == views[id(p)].data_ptr() for p in model.parameters())
        assert engine.stats()["zero_copy_buckets"] == before + 1
    opt.zero_grad(set_to_none=False)
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    assert all(p.grad.data_ptr() == views[id(p)].data_ptr() for p in model.parameters())


# ------------------------------------------------------------------------------ errors
@pytest.mark.world_sizes(2)
def test_bad_arguments_raise(hvd):
    model = _model()
    named = list(model.named_parameters())
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="duplicates: 0.weight"):
        hvd.DistributedOptimizer(_sgd(model), [named[0], named[0], *named[1:]])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(_sgd(model), named[1:])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(_sgd(model), [p for _, p in named])
    with pytest.raises(ValueError, match="only supported with op=Average"):
        hvd.DistributedOptimizer(_sgd(model), named, op=hvd.Sum, gradient_predivide_factor=2)
    with pytest.raises(ValueError, match="only supported with op=Average, got op=Adasum"):
        hvd.DistributedOptimizer(_sgd(model), named, op=hvd.Adasum, gradient_predivide_factor=2)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(_sgd(model), named, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="groups"):
        hvd.DistributedOptimizer(_sgd(model), named, groups=-1)
    with pytest.raises(ValueError, match="torch.Tensor"):
        hvd.DistributedOptimizer(_sgd(model), named, groups=[[1.0]])
    p0 = named[0][1]
    with pytest.raises(ValueError, match="only appear once"):
        hvd.DistributedOptimizer(_sgd(model), named, groups=[[p0], [p0]])
    with pytest.raises(ValueError, match="not a parameter of the optimizer"):
        hvd.DistributedOptimizer(_sgd(model), named, groups=[[torch.zeros(2)]])
    opt = hvd.DistributedOptimizer(_sgd(model), named)
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt, named)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        opt.set_backward_passes_per_step(0)


@pytest.mark.world_sizes(2)
def test_zero_grad_with_pending_reductions_raises(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), model.named_parameters())
    x, y = _batch(0, 0)
    torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    with pytest.raises(OptimizerUsageError):
        opt.zero_grad()
    opt.step()  # the pending reductions complete on every rank
    opt.zero_grad()


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("passes", [1, 2])
def test_more_backward_passes_than_declared_raises(hvd, passes):
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), model.named_parameters(),
                                   backward_passes_per_step=passes)
    x, y = _batch(0, 0)
    for _ in range(passes):
        torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
    with pytest.raises(OptimizerUsageError, match="more than backward_passes_per_step"):
        torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.synchronize()


@NOT_AT_4
def test_step_after_synchronize_without_skip_warns(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(_sgd(model), model.named_parameters())
    x, y = _batch(0, 0)
    torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()


@NOT_AT_4
def test_is_the_wrapped_class_with_its_hooks_and_schedulers(hvd):
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   model.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam"
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = _batch(0, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "scheduler.step() before optimizer.step()"
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(_mine(x)), _mine(y)).backward()
            opt.step()
            scheduler.step()
    assert calls == ["pre", "post"] * 2  # once per step, not once per class layer
    assert opt.param_groups[0]["lr"] == 0.025
