"""Point-to-point messages for the mpitrain c10d backend, outside the engine.

send/recv are not collectives: nothing needs negotiating, and routing them through the
engine's rounds would make a receive wait on every other rank's cycle.  They travel as
non-blocking MPI messages on a communicator of their own, so they can never match the
engine's traffic.  The calling thread posts ``Isend``/``Irecv`` (MPI runs with
MPI_THREAD_MULTIPLE, so any thread may), and only the group's progress thread tests the
request, which keeps each request with a single owner.

The communicator is made with ``MPI_Comm_create_group`` over MPI_COMM_WORLD: that is collective
only over the group's members (torch builds a group's backend only on its members) and does not
touch the communicators the engine thread is using at the same moment.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ...collectives import arrays
from ...core import _mpi
from .work import Progress, Work


def create_comm(world_ranks: list[int], job_comm: Any, name: str) -> Any:
    """A new communicator over ``world_ranks`` (ranks of ``job_comm``), in that order.

    Collective over the members only; every member must pass the same list and ``name`` (the
    torch group's name, the same on every rank), which tags the creation.
    """
    job_group = job_comm.Get_group()
    group = job_group.Incl(list(world_ranks))
    # Over the job's communicator, not MPI_COMM_WORLD: after an elastic rebuild the world
    # still holds the dead ranks, and creating anything over it fails.  torch creates groups
    # one at a time in the same order everywhere; the tag only keeps this creation apart from
    # any other Create_group a member might run concurrently.
    comm = job_comm.Create_group(group, tag=zlib.crc32(name.encode()) % 30000)
    for g in (group, job_group):
        g.Free()
    return comm


class PointToPoint:
    """send/recv among the ranks of one communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        MPI = _mpi.load()
        self._tag_ub = int(comm.Get_attr(MPI.TAG_UB) or 32767)

    def _buffer(self, tensor: torch.Tensor, what: str) -> Any:
        arrays.check_tensor(tensor, what)
        MPI = _mpi.load()
        return [arrays.storage_view(tensor).reshape(-1).view("uint8"), MPI.BYTE]

    def _check_tag(self, tag: int) -> int:
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            raise ValueError(f"tag={tag!r}: the mpitrain backend takes tags 0..{self._tag_ub}")
        return tag

    def send(self, tensor: torch.Tensor, dst: int, tag: int, progress: Progress) -> Work:
        """Post a send of ``tensor`` to rank ``dst``; the Work completes once it is sent."""
        # A GPU tensor travels from a host copy (MPI here need not be CUDA-aware); the copy
        # is complete when .cpu() returns, so the caller may reuse the tensor at once.
        staged = tensor.detach().cpu() if tensor.is_cuda else tensor
        request = self.comm.Isend(self._buffer(staged, "send tensor"), dest=dst,
                                  tag=self._check_tag(tag))

        def poll(keep: torch.Tensor = staged) -> bool:
            # ``keep`` holds the host copy for as long as MPI may read it.
            return bool(request.Test())

        work = Work([tensor], poll=poll, describe=f"send to rank {dst}")
        progress.watch(work)
        return work

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int,
             progress: Progress) -> Work:
        """Post a receive into ``tensor`` from ``src`` (None: any rank)."""
        MPI = _mpi.load()
        source = MPI.ANY_SOURCE if src is None else src
        # A GPU tensor receives into a host buffer, copied onto the device once it arrived.
        landing = torch.empty_like(tensor, device="cpu") if tensor.is_cuda else tensor
        request = self.comm.Irecv(self._buffer(landing, "recv tensor"), source=source,
                                  tag=self._check_tag(tag))
        status = MPI.Status()
        described = "any rank" if src is None else f"rank {src}"
        work = Work([tensor], describe=f"recv from {described}")

        def poll() -> bool:
            if not request.Test(status):
                return False
            work.source_rank_value = status.Get_source()
            count = status.Get_count(MPI.BYTE)
            if count != tensor.numel() * tensor.element_size():
                raise ValueError(f"recv from rank {work.source_rank_value}: {count} bytes "
                                 f"arrived for a tensor of {tensor.numel() * tensor.element_size()}"
                                 " bytes; size the receive like the send")
            if landing is not tensor:
                tensor.copy_(landing)
            return True

        work._poll = poll
        progress.watch(work)
        return work


__all__ = ["PointToPoint", "create_comm"]
