"""Runtime and topology at every world size, and under emulated multi-node layouts."""

import os

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
# One node of 4 covers what one node of 2 does; 2x2 and 3=2+1 cover several nodes.
MPI_CONFIGS = ("np1", "np4", "2x2", "3=2+1")


def expected_layout(rank: int, size: int) -> tuple[int, int, int, int]:
    """(local_rank, local_size, cross_rank, cross_size) for consecutive-block nodes."""
    k = int(os.environ.get("MPITRAIN_LOCAL_SIZE", "0")) or size
    node, local = divmod(rank, k)
    nodes = -(-size // k)
    local_size = min(k, size - node * k)
    cross_size = sum(1 for n in range(nodes) if local < min(k, size - n * k))
    return local, local_size, node, cross_size


def test_rank_and_size_match_mpi(hvd):
    assert hvd.rank() == WORLD.Get_rank()
    assert hvd.size() == WORLD.Get_size()
    assert hvd.is_initialized()


def test_local_and_cross_layout(hvd):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    got = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    assert got == expected_layout(rank, size)


def test_homogeneity(hvd):
    size = WORLD.Get_size()
    k = int(os.environ.get("MPITRAIN_LOCAL_SIZE", "0")) or size
    assert hvd.is_homogeneous() == (size % k == 0)


def test_thread_level_and_flags(hvd):
    assert hvd.mpi_threads_supported() is True
    assert hvd.mpi_enabled() is True
    assert hvd.gloo_enabled() is False
    assert hvd.mpi_built() is True
    assert hvd.nccl_built() is False


def test_init_twice_is_harmless(hvd):
    before = (hvd.rank(), hvd.size(), hvd.local_rank())
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank()) == before


def test_cpu_threads_share_the_machine(hvd):
    import torch

    state = hvd.core.runtime.state()
    if "OMP_NUM_THREADS" not in os.environ:
        expected = max(1, (os.cpu_count() or 1) // state.topology.machine_local_size)
        assert torch.get_num_threads() == expected == state.cpu_threads


def test_reinit_with_a_split_communicator(hvd):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError):
        hvd.rank()
    sub = WORLD.Split(rank % 2, key=rank)
    hvd.init(comm=sub)
    try:
        assert hvd.size() == sub.Get_size() and hvd.rank() == sub.Get_rank()
        import numpy as np

        total = hvd.allreduce(np.array([rank], dtype=np.int64), op=hvd.Sum)
        assert total[0] == sum(r for r in range(size) if r % 2 == rank % 2)
    finally:
        hvd.shutdown()
        sub.Free()
        hvd.init()
    assert hvd.size() == size


def test_init_with_a_list_of_ranks(hvd):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    hvd.shutdown()
    members = list(range(0, size, 2))
    try:
        if rank in members:
            hvd.init(comm=members)
            assert hvd.size() == len(members) and hvd.rank() == members.index(rank)
            hvd.barrier()
            hvd.shutdown()
        else:
            with pytest.raises(ValueError, match=f"world rank {rank} is not in"):
                hvd.init(comm=members)
    finally:
        WORLD.Barrier()
        hvd.init()


def test_init_rejects_bad_arguments(hvd):
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match="distinct"):
            hvd.init(comm=[0, 0])
        with pytest.raises(TypeError, match="communicator or a list"):
            hvd.init(comm="all")
    finally:
        hvd.init()
