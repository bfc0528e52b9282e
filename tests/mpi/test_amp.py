"""Mixed precision with DistributedOptimizer: torch's GradScaler order cannot diverge.

Every rank trains on its own data.  torch's documented order (``unscale_`` and clipping before
``scaler.step``) must give the same parameters as Horovod's order (``synchronize()`` first,
then ``skip_synchronize()``), identical on every rank; before GradScaler waited for the
reductions, it unscaled and clipped local gradients while the engine averaged them and the
replicas drifted apart.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from mpi4py import MPI

MPI_CONFIGS = ("np2",)  # GradScaler orders: no size-specific path
WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _batch(step: int, poison: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + RANK)
    x = torch.randn(8, 16, generator=gen) * (RANK + 1)
    if poison:
        x[0, 0] = float("inf")  # this rank's gradients overflow
    return x, torch.randint(0, 4, (8,), generator=gen)


def _train(hvd, order: str, steps: int = 4, poison_step: int | None = None,
           dtype: torch.dtype = torch.float16) -> tuple[torch.nn.Module, list[float]]:
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                  enabled=dtype == torch.float16)
    scales = []
    for step in range(steps):
        x, y = _batch(step, poison=poison_step == step and RANK == 0)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if order == "torch":  # torch's docs: unscale_, clip, scaler.step
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
        elif order == "torch_no_unscale":  # scaler.step unscales by itself
            scaler.step(opt)
        elif order == "horovod":  # Horovod's docs
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            raise AssertionError(order)
        scaler.update()
        scales.append(float(scaler.get_scale()) if scaler.is_enabled() else 1.0)
    return model, scales


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_every_rank(t: torch.Tensor) -> None:
    gathered = WORLD.allgather(t.numpy().tobytes())
    assert all(g == gathered[0] for g in gathered), "replicas diverged"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_torch_order_equals_horovod_order(hvd, dtype) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() without skip_synchronize" warning either
        torch_model, _ = _train(hvd, "torch", dtype=dtype)
    horovod_model, _ = _train(hvd, "horovod", dtype=dtype)
    _same_on_every_rank(_flat(torch_model))
    _same_on_every_rank(_flat(horovod_model))
    torch.testing.assert_close(_flat(torch_model), _flat(horovod_model), rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_scaler_step_without_unscale(hvd) -> None:
    plain, _ = _train(hvd, "torch_no_unscale")
    _same_on_every_rank(_flat(plain))


@pytest.mark.timeout(120)
def test_overflow_on_one_rank_skips_the_step_everywhere(hvd) -> None:
    """Averaged gradients carry one rank's inf to all: every rank skips and halves the scale."""
    model, scales = _train(hvd, "torch", steps=3, poison_step=1)
    _same_on_every_rank(_flat(model))
    assert scales[1] == scales[0] / 2
    assert WORLD.allgather(scales) == [scales] * SIZE
    assert torch.isfinite(_flat(model)).all()
