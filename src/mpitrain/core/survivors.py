"""Who is left after a rank died: ULFM's revoke and shrink, where the MPI library has them.

With ULFM (Open MPI 5 run with ``mpirun --with-ft ulfm``), a collective that involves a dead
rank fails on the ranks that notice, with ``MPI_ERR_PROC_FAILED``.  Ranks that wait on a live
peer which is itself stuck would wait forever, so the rank that notices first *revokes* the
communicators it uses: every pending and later operation on them fails everywhere with
``MPI_ERR_REVOKED``.  The survivors then *shrink* the job's communicator: a collective among
the live ranks that agrees on who they are and returns a new communicator of just them.

Without ULFM (MPICH, an older Open MPI), ``Shrink`` either does not exist or raises; the
callers then fall back to rebuilding over the communicator they had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from . import _mpi


def revoke(comms: Iterable[Any]) -> None:
    """Revoke every communicator of ``comms`` that can be revoked (best effort, local).

    Called by a rank whose collective failed, so that no peer stays blocked in a collective
    the failed one will never join.  Not collective; revoking twice is harmless.
    """
    MPI = _mpi.load()
    for comm in comms:
        if comm is None or comm == MPI.COMM_NULL:
            continue
        with contextlib.suppress(Exception):  # no ULFM, or already freed: nothing to interrupt
            comm.Revoke()


def release(comm: Any) -> None:
    """Free ``comm`` (best effort), unless it was revoked.

    After a failure, peers may still have messages on their way to a revoked communicator.
    Once freed, its context id goes to the next communicator this process creates, and Open
    MPI 5 takes such a late message for one of the new communicator's and aborts the process
    (seen in elastic rebuilds: ``MPI_Comm_dup`` of the survivors' communicator aborting in
    ``mca_pml_ob1_add_comm``).  A revoked communicator is kept, unused, until the process ends:
    a few per recovery.
    """
    if comm is None:
        return
    with contextlib.suppress(Exception):  # best effort at teardown; COMM_NULL, already freed
        is_revoked = getattr(comm, "Is_revoked", None)
        if is_revoked is not None and is_revoked():
            return
        comm.Free()


def shrink(comm: Any) -> Any | None:
    """A new communicator of the ranks of ``comm`` that are still alive, or None without ULFM.

    Collective over the live ranks of ``comm`` (dead ones are skipped; a revoked ``comm`` is
    fine).  Ranks keep their relative order.  The caller frees the result.

    Raises:
        mpi4py.MPI.Exception: the MPI library failed inside the shrink itself.
    """
    shrink_op = getattr(comm, "Shrink", None)
    if shrink_op is None:  # an mpi4py or MPI without the ULFM interface
        return None
    try:
        return shrink_op()
    except NotImplementedError:  # mpi4py built against an MPI without MPIX_Comm_shrink
        return None


def agree(comm: Any, flag: bool) -> bool:
    """True on every live rank of ``comm`` if every live rank passed True, else False everywhere.

    ULFM's agreement is fault tolerant and uniform: a rank that died before or during it
    cannot make the live ranks disagree.  A failure it reports (a death not yet acknowledged)
    counts as False: the callers then start over.
    """
    try:
        return bool(comm.Agree(int(flag)))
    except Exception:  # noqa: BLE001 - MPI_ERR_PROC_FAILED: someone died, go round again
        return False


def lost_ranks(before: Any, after: Any) -> list[int]:
    """The MPI_COMM_WORLD ranks of the processes in ``before`` but not in ``after``.

    World ranks, because they name the same process across any number of rebuilds (and are
    what mpirun's own messages and a rank's log files use).
    """
    MPI = _mpi.load()
    old, new, world = before.Get_group(), after.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        members = list(range(old.Get_size()))
        kept = MPI.Group.Translate_ranks(old, members, new)
        in_world = MPI.Group.Translate_ranks(old, members, world)
    finally:
        for group in (old, new, world):
            group.Free()
    return [w for w, k in zip(in_world, kept) if k == MPI.UNDEFINED]


def new_ranks(before: Any, after: Any) -> list[int | None]:
    """For each rank of ``before``, its rank in ``after`` (None for a process not in it)."""
    MPI = _mpi.load()
    old, new = before.Get_group(), after.Get_group()
    try:
        kept = MPI.Group.Translate_ranks(old, list(range(old.Get_size())), new)
    finally:
        old.Free()
        new.Free()
    return [None if k == MPI.UNDEFINED else int(k) for k in kept]


__all__ = ["agree", "lost_ranks", "new_ranks", "revoke", "shrink"]
