"""Stock torch DDP over backend="mpitrain" trains exactly like stock DDP over Gloo.

One job, two process groups: the default group is mpitrain's (plain
``init_process_group("mpitrain")`` under mpirun) and a Gloo group over the same ranks uses the
TCP store that the mpitrain env:// fallback served from rank 0.
"""

import pytest
import torch
import torch.distributed as dist
from ddp_common import make_model, train_lockstep
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

from mpitrain import runtime

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
MPI_CONFIGS = ("np2", "np4")


@pytest.fixture(scope="module")
def groups(hvd):
    dist.init_process_group(backend="mpitrain")
    gloo = dist.new_group(backend="gloo")
    yield dist.group.WORLD, gloo
    dist.destroy_process_group()


def assert_same_on_every_rank(module: torch.nn.Module) -> None:
    mine = [p.detach().numpy().tobytes() for p in module.parameters()]
    assert WORLD.allgather(mine) == [mine] * SIZE


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0005], ids=["one_bucket", "many_buckets"])
def test_ddp_mpitrain_equals_ddp_gloo(groups, bucket_cap_mb):
    mpi_group, gloo_group = groups
    engine = runtime.state().engine
    before = engine.stats()["collectives"]
    a = DDP(make_model(seed=RANK), process_group=mpi_group, bucket_cap_mb=bucket_cap_mb)
    b = DDP(make_model(seed=RANK), process_group=gloo_group, bucket_cap_mb=bucket_cap_mb)
    train_lockstep(a, b, RANK, steps=4)
    assert_same_on_every_rank(a.module)
    # The mpitrain DDP really went through the engine: start-up checks, buffer broadcasts and
    # one allreduce per bucket per step.
    assert engine.stats()["collectives"] - before >= 4


def test_ddp_find_unused_parameters_and_no_sync(groups):
    mpi_group, gloo_group = groups
    a = DDP(make_model(seed=RANK), process_group=mpi_group, find_unused_parameters=True)
    b = DDP(make_model(seed=RANK), process_group=gloo_group, find_unused_parameters=True)
    train_lockstep(a, b, RANK, steps=4, skip_odd=True)
    a = DDP(make_model(seed=RANK), process_group=mpi_group)
    b = DDP(make_model(seed=RANK), process_group=gloo_group)
    train_lockstep(a, b, RANK, steps=2, accumulate=3, no_sync=True)
    assert_same_on_every_rank(a.module)
