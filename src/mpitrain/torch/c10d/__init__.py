"""mpitrain as a torch.distributed (c10d) backend, the way ACCL, HCCL and oneCCL plug in.

``import mpitrain.torch`` (or the first use of a name of ``import mpitrain as hvd``) calls
:func:`register`, after which

    torch.distributed.init_process_group(backend="mpitrain")      # under mpirun, no env vars

gives a default process group whose collectives run on mpitrain's engine, and stock
``torch.nn.parallel.DistributedDataParallel`` (or anything built on torch.distributed) uses it.
Registration only touches torch's backend table and wraps its ``env://`` rendezvous (see
:mod:`.rendezvous`); MPI starts when the process group is created.

Groups: the default group, ``new_group`` over all ranks, and ``new_group(ranks)`` over a subset
whose ranks form an mpitrain process set registered beforehand (``mpitrain.add_process_set`` on
every rank).  torch builds a subgroup's backend only on the subgroup's members, while an
mpitrain process set must be registered by every rank, so the backend cannot create the set by
itself.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ... import session
from ...core import runtime
from ...core.process_sets import ProcessSet, global_process_set, registered_process_sets
from . import rendezvous
from .p2p import PointToPoint, create_comm
from .process_group import BACKEND_NAME, ProcessGroupMpitrain
from .work import Work


def _process_set_for(members: list[int]) -> ProcessSet:
    size = runtime.size()
    if members == list(range(size)):
        return global_process_set
    for ps in registered_process_sets():
        if ps.ranks == members:
            return ps
    raise ValueError(f"new_group(ranks={members}, backend='mpitrain'): register those ranks as "
                     f"an mpitrain process set first, on every rank and before new_group "
                     f"(mpitrain.add_process_set({members})); torch creates a subgroup's backend "
                     "only on its members, and process sets are registered by all ranks")


def _create_group(opts: Any) -> ProcessGroupMpitrain:
    members = [int(r) for r in opts.global_ranks_in_group]
    is_default = not members
    if not runtime.is_initialized():
        if not is_default and len(members) != dist.get_world_size():
            raise ValueError("the mpitrain backend needs mpitrain.init() (collective over all "
                             "ranks) before a subgroup is created")
        session.init()
    size, rank = runtime.size(), runtime.rank()
    if is_default:
        members = list(range(opts.group_size))
        if opts.group_size != size or opts.group_rank != rank:
            raise ValueError(f"init_process_group(backend='mpitrain') got rank {opts.group_rank} "
                             f"of {opts.group_size}, but MPI says rank {rank} of {size}; launch "
                             "with mpirun (or mpitrainrun) and leave RANK/WORLD_SIZE unset")
    elif dist.is_initialized() and dist.get_rank() != rank:
        raise ValueError(f"torch.distributed rank {dist.get_rank()} differs from mpitrain rank "
                         f"{rank}; the mpitrain backend needs the two numberings to agree")
    process_set = _process_set_for(members)
    comm = create_comm(members, runtime.state().comms.world, str(opts.group_id))
    return ProcessGroupMpitrain(opts.group_rank, opts.group_size, process_set, members,
                                PointToPoint(comm), str(opts.group_id))


_rebuilding = {"hooked": False, "recreate": False}


def _before_rebuild() -> None:
    """An elastic rebuild is about to change the job's size: destroy torch's default group
    (and its subgroups) if it is mpitrain's, so that it can be created again over the new job
    (a group of the old size would be refused by init(), and its collectives would hang)."""
    _rebuilding["recreate"] = False
    if dist.is_initialized() and dist.get_backend() == BACKEND_NAME:
        dist.destroy_process_group()
        rendezvous.forget_store()
        _rebuilding["recreate"] = True


def _after_rebuild() -> None:
    """Create torch's default group again over the rebuilt job (collective).  Objects that
    held the old groups (a torch DDP wrapper, subgroups from new_group) must be created again
    by the user, e.g. in an elastic reset callback."""
    if _rebuilding["recreate"] and not dist.is_initialized():
        dist.init_process_group(backend=BACKEND_NAME)
    _rebuilding["recreate"] = False


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupMpitrain:
    """torch's creator hook (extended API): build the process group for one torch group."""
    pg = _create_group(opts)
    if not _rebuilding["hooked"]:
        session.on_rebuild(_before_rebuild, _after_rebuild)
        _rebuilding["hooked"] = True
    return pg


def init_default_group() -> None:
    """Create torch's default process group over mpitrain, with rank and size from MPI.

    What ``dist.init_process_group(backend="mpitrain")`` does under mpirun, whatever the
    environment holds (RANK/WORLD_SIZE, if set, must agree with MPI; MASTER_ADDR/MASTER_PORT,
    if set, place the store).  Collective over every rank of the job.

    Raises:
        ValueError: torch already has a default process group.
    """
    if dist.is_initialized():
        raise ValueError(f"torch already has a default process group (backend "
                         f"{dist.get_backend()!r}); mpitrain creates one only where none exists")
    register()
    store, rank, size = next(rendezvous.mpi_rendezvous("env://", dist.default_pg_timeout))
    dist.init_process_group(BACKEND_NAME, store=store, rank=rank, world_size=size)


def register() -> None:
    """Register the "mpitrain" backend with torch.distributed (idempotent, communicates nothing)."""
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        # CUDA tensors go through the engine's device path (staged or CUDA-aware MPI).
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    rendezvous.install()


__all__ = ["BACKEND_NAME", "ProcessGroupMpitrain", "Work", "init_default_group", "register"]
