"""``import mpitrain.torch.distributed as dist``: the torch.distributed calls a DDP script makes.

A script written against torch.distributed switches two imports and keeps the rest:

    import mpitrain.torch.distributed as dist
    from mpitrain.torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group(backend="nccl")     # any name: mpitrain initialises from MPI
    model = DDP(model)

Everything here runs on mpitrain's runtime.  :func:`init_process_group` also makes torch's
default process group an mpitrain one (what ``torch.distributed.init_process_group(
backend="mpitrain")`` gives), so that libraries built on torch.distributed (Hugging Face's
Trainer and Accelerate, stock DDP) see the real world and communicate through mpitrain too.

``use_mpitrain`` is AIACC-style feature detection: it is True in this module, meaning that
collectives issued through it and through the DDP drop-in run on mpitrain's engine, so a script
that may also run on stock torch can test ``getattr(dist, "use_mpitrain", False)``.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from .. import collectives, session
from ..collectives import Handle
from ..core import runtime
from ..core.process_sets import ProcessSet, global_process_set
from . import functions

use_mpitrain = True


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: datetime.timedelta | None = None, world_size: int = -1,
                       rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None) -> None:
    """Initialise mpitrain (collective over the job); torch's signature, MPI's rank and size.

    ``backend`` may be any name ("nccl", "gloo", "mpitrain", ...): mpitrain chooses its own
    transport.  ``init_method``, ``store``, ``timeout``, ``group_name``, ``pg_options`` and
    ``device_id`` are accepted for compatibility and not needed: MPI already knows the job.

    Raises:
        ValueError: ``world_size`` or ``rank`` was given and disagrees with MPI.
    """
    del backend, init_method, store, group_name, pg_options, device_id
    session.init()
    if world_size not in (-1, None) and int(world_size) != runtime.size():
        raise ValueError(f"init_process_group(world_size={world_size}) disagrees with MPI's "
                         f"{runtime.size()} processes; leave it at -1 under mpirun")
    if rank not in (-1, None) and int(rank) != runtime.rank():
        raise ValueError(f"init_process_group(rank={rank}) disagrees with MPI's rank "
                         f"{runtime.rank()}; leave it at -1 under mpirun")
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        # Collective, like this whole call; the world size was checked against MPI by init().
        torch.distributed.init_process_group(backend="mpitrain", timeout=timeout)


def destroy_process_group(group: Any = None) -> None:
    """Destroy torch's default process group, then shut mpitrain down (collective)."""
    del group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    session.shutdown()


def is_initialized() -> bool:
    """True once :func:`init_process_group` (or ``mpitrain.init``) has run."""
    return runtime.is_initialized()


def is_available() -> bool:
    """True: mpitrain's distributed support is always built."""
    return True


def get_rank(group: ProcessSet | None = None) -> int:
    """This process's rank in the job, or in ``group`` (a ProcessSet; -1 if not a member)."""
    if group is None or group is global_process_set:
        return runtime.rank()
    set_rank = group.rank()
    return -1 if set_rank is None else set_rank


def get_world_size(group: ProcessSet | None = None) -> int:
    """Number of processes in the job, or in ``group`` (a registered ProcessSet)."""
    if group is None or group is global_process_set:
        return runtime.size()
    size = group.size()
    if size is None:
        raise ValueError(f"{group!r} is not registered")
    return size


def get_local_rank() -> int:
    """This process's index on its node (what torchrun calls LOCAL_RANK)."""
    return runtime.local_rank()


def get_local_world_size() -> int:
    """Number of processes on this node."""
    return runtime.local_size()


def barrier(group: ProcessSet | None = None, async_op: bool = False,
            device_ids: Any = None) -> Handle | None:
    """Wait until every rank of the job (or of ``group``) has entered the barrier.

    Returns:
        With ``async_op=True`` a handle whose ``wait()`` returns once everyone has arrived;
        otherwise None, after everyone has.
    """
    del device_ids
    handle = collectives.barrier_async(global_process_set if group is None else group)
    if async_op:
        return handle
    handle.wait()
    return None


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's optimizer state (and hyper-parameters) with ``root_rank``'s.

    Collective over ``process_set``; see :func:`mpitrain.torch.functions.
    broadcast_optimizer_state` (the one implementation) for the details.
    """
    functions.broadcast_optimizer_state(optimizer, root_rank, process_set=process_set)


__all__ = [
    "barrier",
    "broadcast_optimizer_state",
    "destroy_process_group",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_initialized",
    "use_mpitrain",
]
