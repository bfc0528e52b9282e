"""Choose an algorithm for each collective; today every collective goes to MPI's own."""

from __future__ import annotations

from .mpi import (
    allgather,
    allgather_int,
    allreduce,
    alltoall,
    alltoall_int,
    barrier,
    broadcast,
    reducescatter,
)

__all__ = [
    "allgather",
    "allgather_int",
    "allreduce",
    "alltoall",
    "alltoall_int",
    "barrier",
    "broadcast",
    "reducescatter",
]
