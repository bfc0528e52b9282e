"""``import mpitrain.torch.distributed as dist``: torch.distributed's face on mpitrain."""

import pytest
import torch
from mpi4py import MPI

import mpitrain.torch.distributed as dist

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "2x2")


def test_init_accepts_any_backend_and_reports_mpi_layout(hvd):
    for backend in ("nccl", "gloo", "mpitrain", None):
        dist.init_process_group(backend=backend)
    dist.init_process_group("nccl", world_size=SIZE, rank=RANK)
    assert dist.is_initialized() and dist.is_available()
    assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
    assert (dist.get_local_rank(), dist.get_local_world_size()) == (hvd.local_rank(),
                                                                     hvd.local_size())
    assert dist.use_mpitrain is True


def test_init_rejects_a_layout_mpi_disagrees_with(hvd):
    with pytest.raises(ValueError, match="world_size"):
        dist.init_process_group("gloo", world_size=SIZE + 1)
    with pytest.raises(ValueError, match="rank"):
        dist.init_process_group("gloo", rank=(RANK + 1) % (SIZE + 1))


def test_barrier_sync_async_and_on_a_process_set(hvd):
    dist.barrier()
    dist.barrier(async_op=True).wait()
    ps = hvd.add_process_set([0, SIZE - 1])
    try:
        if RANK in (0, SIZE - 1):
            dist.barrier(group=ps)
            assert dist.get_world_size(ps) == 2
            assert dist.get_rank(ps) == (0 if RANK == 0 else 1)
        else:
            assert dist.get_rank(ps) == -1
    finally:
        hvd.remove_process_set(ps)


def test_broadcast_optimizer_state(hvd):
    torch.manual_seed(RANK)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * (RANK + 1), momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    dist.broadcast_optimizer_state(opt, root_rank=0)
    mine = opt.state_dict()
    assert mine["param_groups"][0]["lr"] == pytest.approx(0.01)
    states = [s["momentum_buffer"].numpy().tobytes() for s in mine["state"].values()]
    assert WORLD.allgather(states) == [states] * SIZE
    with pytest.raises(TypeError, match="Optimizer"):
        dist.broadcast_optimizer_state(model, root_rank=0)
