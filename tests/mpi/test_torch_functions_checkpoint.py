"""broadcast_parameters, broadcast_optimizer_state, and rank-0 checkpoints with exact resume."""

from __future__ import annotations

import os
import random
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpitrain as hvd

MPI_CONFIGS = ("np2",)  # broadcast/checkpoint helpers: no size-specific path
SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                               torch.nn.Dropout(0.3), torch.nn.Linear(6, 2))


def _equal_everywhere(tensors) -> bool:
    mine = [t.detach().clone() for t in tensors]
    return all(all(torch.equal(a, b) for a, b in zip(mine, other))
               for other in hvd.allgather_object(mine))


@pytest.fixture
def shared_dir():
    """One directory every rank sees (rank 0 makes it)."""
    path = hvd.broadcast_object(tempfile.mkdtemp(prefix="mpitrain-ckpt-") if RANK == 0
                                else None)
    yield path
    hvd.barrier()


# -------------------------------------------------------------------- broadcast helpers
@pytest.mark.parametrize("form", ["state_dict", "module", "parameters", "named_parameters"])
def test_broadcast_parameters(hvd, form):
    model = _model(seed=RANK)
    root = SIZE - 1  # not rank 0, where there is another
    root_values = hvd.broadcast_object([t.clone() for t in model.state_dict().values()], root)
    params = {"state_dict": model.state_dict(), "module": model,
              "parameters": model.parameters(),
              "named_parameters": model.named_parameters()}[form]
    hvd.broadcast_parameters(params, root_rank=root)
    checked = model.state_dict().values() if form in ("state_dict", "module") else \
        model.parameters()
    assert _equal_everywhere(checked)
    if form in ("state_dict", "module"):
        for got, want in zip(model.state_dict().values(), root_values):
            assert torch.equal(got, want)


def test_broadcast_optimizer_state_with_state_and_hyper_parameters(hvd):
    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (RANK + 1), betas=(0.8, 0.9))
    model.train()
    torch.manual_seed(RANK)
    for _ in range(RANK + 1):  # different numbers of steps: different state everywhere
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    assert opt.param_groups[0]["lr"] == 0.01
    state = [v for s in opt.state.values() for v in s.values()]
    assert _equal_everywhere(state)
    assert _equal_everywhere(model.state_dict().values())


def test_broadcast_optimizer_state_of_fresh_optimizer(hvd):
    model = _model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1), momentum=0.5 + 0.1 * RANK)
    if RANK != 0:  # a rank with state must end up with the root's (empty) state
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.5
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step taken


def test_broadcast_optimizer_state_of_distributed_optimizer(hvd):
    model = _model(seed=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 + RANK,
                                                   momentum=0.9), model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.1


@pytest.mark.world_sizes(2)
def test_broadcast_errors(hvd):
    model = _model(seed=0)
    with pytest.raises(TypeError, match="state dict, a module, or a list"):
        hvd.broadcast_parameters(torch.zeros(3), root_rank=0)
    with pytest.raises(TypeError, match="not a tensor"):
        hvd.broadcast_parameters({"a": 1.0}, root_rank=0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.broadcast_optimizer_state(model, root_rank=0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params if RANK == 0 else params[:2], lr=0.1)
    with pytest.raises(ValueError, match="optimizers differ between ranks"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)


def test_object_helpers_are_exported(hvd):
    import mpitrain.torch as hvd_torch

    assert hvd_torch.broadcast_object({"r": RANK}, root_rank=0) == {"r": 0}
    assert hvd_torch.allgather_object(RANK) == list(range(SIZE))


# -------------------------------------------------------------------------- checkpoints
def _train(total_steps: int, path: str, stop_after: int | None = None,
           resume: bool = False) -> list[torch.Tensor]:
    """Dropout (torch RNG), numpy and random noise, a shuffled sampler, momentum: all of
    them must continue exactly after a resume."""
    data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=torch.Generator()
                                                      .manual_seed(7)),
                                          torch.randn(40, 2, generator=torch.Generator()
                                                      .manual_seed(8)))
    model = _model(seed=99 if resume else 0)  # a resume starts from the wrong weights
    # One group: the same fused request every step.  Otherwise which gradients share a
    # reduction depends on timing, and with more than two ranks the summation order (so the
    # last bit) can differ between any two runs, resumed or not.
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), groups=1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sampler = hvd.DistributedSampler(data, shuffle=True, seed=3)
    # Its own generator: a DataLoader otherwise draws from torch's global RNG whenever an
    # iteration starts, which a resume mid-epoch would do one time more.
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler,
                                         generator=torch.Generator())
    torch.manual_seed(1000 + RANK + (500 if resume else 0))
    np.random.seed(RANK + (50 if resume else 0))
    random.seed(RANK + (70 if resume else 0))
    step = epoch = 0
    if resume:
        extra = hvd.load_checkpoint(path, model=model, optimizer=opt, sampler=sampler)
        step, epoch = extra["step"], extra["epoch"]
    while step < total_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            noise = torch.from_numpy(np.random.randn(*x.shape).astype(np.float32))
            x = x + 0.01 * noise + 0.001 * random.random()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
            if step == stop_after:
                hvd.save_checkpoint(path, model=model, optimizer=opt, sampler=sampler,
                                    keep_last=2, epoch=epoch, step=step)
                return []
            if step == total_steps:
                break
        else:
            epoch += 1
    # Parameters everywhere; buffers (BatchNorm running statistics, which each rank keeps
    # for itself) only on rank 0, whose copy the checkpoint holds.
    kept = model.state_dict().values() if RANK == 0 else model.parameters()
    return [t.detach().clone() for t in kept]


@pytest.mark.parametrize("stop_after", [3, 7])  # mid-epoch, and into the second epoch
def test_resume_is_bitwise_identical(hvd, shared_dir, stop_after):
    path = os.path.join(shared_dir, "run-{step:04d}.pt")
    total = 2 * stop_after
    want = _train(total, path)
    _train(total, path, stop_after=stop_after)
    got = _train(total, path, resume=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_keep_last_and_latest(hvd, shared_dir):
    model = _model(seed=0)
    template = os.path.join(shared_dir, "ck-{step}.pt")
    for step in range(4):
        written = hvd.save_checkpoint(template, model=model, keep_last=2, step=step)
        assert written == os.path.join(shared_dir, f"ck-{step}.pt")
    if RANK == 0:
        assert sorted(os.listdir(shared_dir)) == ["ck-2.pt", "ck-3.pt"]
    assert hvd.load_checkpoint(template, model=model)["step"] == 3
    assert hvd.load_checkpoint(os.path.join(shared_dir, "ck-2.pt"))["step"] == 2


@pytest.mark.world_sizes(2)
def test_checkpoint_errors(hvd, shared_dir):
    model = _model(seed=0)
    with pytest.raises(FileNotFoundError, match="rank 0 could not read"):
        hvd.load_checkpoint(os.path.join(shared_dir, "missing.pt"), model=model)
    with pytest.raises(FileNotFoundError, match="no checkpoint matches"):
        hvd.load_checkpoint(os.path.join(shared_dir, "none-{step}.pt"))
    with pytest.raises(ValueError, match="keep_last"):
        hvd.save_checkpoint(os.path.join(shared_dir, "x-{step}.pt"), keep_last=0, step=1)
    with pytest.raises(ValueError, match="needs a path template"):
        hvd.save_checkpoint(os.path.join(shared_dir, "x.pt"), keep_last=2)
    with pytest.raises(ValueError, match="not among the extras"):
        hvd.save_checkpoint(os.path.join(shared_dir, "x-{step}.pt"), epoch=1)
    plain = os.path.join(shared_dir, "plain.pt")
    if RANK == 0:
        torch.save({"weights": torch.zeros(2)}, plain)
    hvd.barrier()
    with pytest.raises(ValueError, match="not an mpitrain checkpoint"):
        hvd.load_checkpoint(plain)
    hvd.save_checkpoint(os.path.join(shared_dir, "nomodel.pt"), step=1)
    with pytest.raises(ValueError, match="holds no optimizer state"):
        hvd.load_checkpoint(os.path.join(shared_dir, "nomodel.pt"),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    blocked = os.path.join(shared_dir, "file-not-dir")
    if RANK == 0:
        open(blocked, "w").close()
    hvd.barrier()
    with pytest.raises(OSError, match="rank 0 could not write"):
        hvd.save_checkpoint(os.path.join(blocked, "ck.pt"), model=model)
