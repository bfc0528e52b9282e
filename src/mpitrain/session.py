"""The job's life: ``init()`` and ``shutdown()``, the engine they start and stop, and the
registration of process sets (which the engine negotiates).

One floor above :mod:`mpitrain.core.runtime`: ``init()`` starts the runtime (configuration,
topology, communicators, device binding), then builds and starts the engine on it;
``shutdown()`` stops the engine, then the runtime.  Everything above (the front door in
:mod:`mpitrain.collectives`, the adapters) reaches the engine only through :func:`engine`, so
this is the one place that owns its life: elastic training rebuilds from here.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .core import _mpi, departures, finalize, runtime, survivors
from .core.departures import Phase
from .core.errors import MpitrainInternalError, not_initialized
from .core.process_sets import ProcessSet, global_process_set, registry
from .engine.device import cuda_awareness
from .engine.engine import Engine
from .engine.request import Kind, Request

_engine: Engine | None = None
_lock = threading.RLock()
_atexit_registered = False
_job_comm: Any = None  # init()'s ``comm`` argument: what a rebuild without ULFM starts over
# (before, after) pairs adapters register: run around every rebuild (see on_rebuild).
_rebuild_hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []


def init(comm: Any = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Initialise mpitrain: communicators, topology, device binding and the engine.

    Every rank of ``comm`` must call this, in the same order (it is collective).  Calling it
    again while initialised does nothing.

    Args:
        comm: ``None`` for MPI_COMM_WORLD, an mpi4py communicator (duplicated), or a list of
            world ranks that form the job.
        process_sets: ProcessSet objects to register now (every rank passes the same list), or
            ``"dynamic"`` (accepted for Horovod compatibility: sets may always be added later).

    Raises:
        ValueError: this process is not part of ``comm``, the rank list is malformed, or
            ``process_sets`` is a string other than ``"dynamic"``.
        TypeError: ``comm`` is neither a communicator nor a list of ranks.
        mpitrain.core.launchers.LauncherMismatchError: a launcher started several processes but MPI
            sees a world of one (torchrun, srun without PMI, another MPI's mpirun); see
            :mod:`mpitrain.core.launchers`.
    """
    global _engine, _atexit_registered, _job_comm
    if isinstance(process_sets, str) and process_sets != "dynamic":
        raise ValueError(f"init(process_sets={process_sets!r}): pass a list of ProcessSet "
                         "objects or 'dynamic'")
    with _lock:
        if _engine is not None:
            return
        state = runtime.start(comm)
        try:
            if state.device is not None:
                # A GPU job: decide once, at init, whether MPI takes device pointers.
                cuda_awareness(state.config.cuda_aware_mpi)
            engine = Engine(state.config, state.topology, state.comms)
            engine.start()
        except BaseException:
            # The others' engines may already wait for this one: its exit ends the job.
            runtime.stop()
            departures.enter(Phase.FAILED)
            raise
        _engine = engine
        _job_comm = comm
        # Runs the faces' hooks too (departures.when_running): torch.distributed's backend.
        departures.enter(Phase.RUNNING)
        global_process_set.ranks = list(range(state.topology.size))
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            add_process_set(ps)


def shutdown() -> None:
    """Stop the engine and free mpitrain's communicators; requests in flight fail.

    Safe to call more than once, and called automatically at interpreter exit.
    """
    global _engine
    with _lock:
        engine, _engine = _engine, None
    if engine is None:
        return
    try:
        engine.stop(leaving=True)
    finally:
        registry.forget_all()  # ids are meaningless once the engine that gave them stopped
        runtime.stop()
        # The engine's last round told every rank (they fail what they submit from now on).
        departures.enter(Phase.STOPPED)


def rebuild() -> list[int]:
    """Rebuild the engine and everything above the communicator over the ranks still alive.

    Elastic training calls this after a collective failed.  Every surviving rank must call it
    (it is collective over the survivors).  The engine is stopped (its requests fail), the
    survivors agree on who they are (ULFM's shrink, see :mod:`mpitrain.core.survivors`), and
    topology, communicators, data plane and engine are built again over them: ``rank()`` and
    ``size()`` may change.  A rank dying during the rebuild makes the survivors shrink and
    build again.  Without ULFM the job is rebuilt over the communicator ``init()`` was given.
    Process sets are registered again, in their order, over their surviving members (with
    their new ranks; the same ProcessSet objects, so code holding them keeps working); a set
    whose members all died stays unregistered.

    Returns:
        The MPI_COMM_WORLD ranks of the processes lost; empty when everyone is alive.

    Raises:
        ValueError: mpitrain is not initialised.
    """
    global _engine
    with _lock:
        running = engine()
        comm = _job_comm
        _engine = None
        sets = [(ps, list(ps.ranks)) for ps in registry.in_order()]
        # Until the survivors agree, leaving here leaves them waiting (like leaving init()).
        departures.enter(Phase.STARTING)
        try:
            running.stop()  # the thread has usually ended already, on the failure
            for before_hook, _ in _rebuild_hooks:
                before_hook()
            # Agree on the survivors over the runtime's spare communicator: the engine's are
            # freed (and revoked after a failure), and no other thread talks on this one.
            before = runtime.take_spare()
        finally:
            registry.forget_all()
            runtime.stop()
        try:
            leavers = running.peers_left
            if leavers:
                lost, new_rank_of = _build_without(before, leavers)
            else:
                lost, new_rank_of = _build_over_survivors(before, comm)
        finally:
            before.Free()
    _register_again(sets, new_rank_of)
    for _, after_hook in _rebuild_hooks:
        after_hook()
    if lost:
        _finalize_with_deadline_at_exit()
    return lost


_finalize_registered = False


def _finalize_with_deadline_at_exit() -> None:
    """Once ranks were lost, finish the job at exit with a deadline on MPI_Finalize (see
    :mod:`mpitrain.core.finalize`): registered after init()'s shutdown, so it runs first and shuts
    down itself."""
    global _finalize_registered
    if _finalize_registered:
        return
    _finalize_registered = True
    finalize.note_uncaught_exceptions()

    def at_exit() -> None:
        shutdown()
        finalize.finalize_within()

    atexit.register(at_exit)


def on_rebuild(before: Callable[[], None], after: Callable[[], None]) -> None:
    """Have ``before()`` run on every survivor once a rebuild has stopped the engine (before
    the runtime starts again over the survivors), and ``after()`` once the new job is up.

    For adapters that keep state sized to the old job: torch.distributed's default group is
    destroyed before and created again after (:mod:`mpitrain.torch.c10d`).  ``after`` runs
    collectives of the new job; both run in the order registered.
    """
    _rebuild_hooks.append((before, after))


def _register_again(sets: list[tuple[ProcessSet, list[int]]],
                    new_rank_of: list[int | None]) -> None:
    """Register the process sets of the job before a rebuild over their surviving members
    (every survivor holds the same sets and the same map, so they register alike)."""
    for ps, ranks in sets:
        members = sorted(m for r in ranks if r < len(new_rank_of)
                         and (m := new_rank_of[r]) is not None)
        ps.ranks = members
        if members:
            add_process_set(ps)


def _build_without(before: Any, leavers: list[int]) -> tuple[list[int], list[int | None]]:
    """init() over the ranks of ``before`` except ``leavers``, ranks that shut down while this
    one still ran (their program ended, or called shutdown()): alive but gone, they wait in
    MPI_Finalize and would never join a shrink, so the others build the new job among
    themselves (MPI_Comm_create_group is collective over the group's members only), with or
    without ULFM.  Every rank still running saw the same leavers in the same round."""
    MPI = _mpi.load()
    everyone = before.Get_group()
    rest = everyone.Excl(leavers)
    try:
        sub = before.Create_group(rest)
    finally:
        everyone.Free()
        rest.Free()
    try:
        init(sub)
        return survivors.lost_ranks(before, sub), survivors.new_ranks(before, sub)
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()  # init() works on its own duplicate


def _build_over_survivors(before: Any, comm: Any) -> tuple[list[int], list[int | None]]:
    """Shrink ``before`` to the live ranks and init() over them, until every survivor's init
    succeeded.  A failed attempt is retried only if a rank died since the last one; otherwise
    init() fails the same way again, and its error is raised on every survivor."""
    global _job_comm
    current = before
    error: BaseException | None = None
    try:
        while True:
            shrunk = survivors.shrink(current)
            if shrunk is None:  # no ULFM: start again over what the user gave
                init(comm)
                return [], list(range(before.Get_size()))
            if error is not None and shrunk.Get_size() == current.Get_size():
                shrunk.Free()  # nobody died since the failed attempt: it was not a death
                departures.enter(Phase.STOPPED)  # every survivor raises here, together
                raise error
            if current is not before:
                current.Free()
            current = shrunk
            try:
                init(shrunk)
                error = None
            except Exception as exc:  # noqa: BLE001 - agreed on below, raised if not a death
                error = exc
                survivors.revoke([shrunk])  # a peer may wait for us in a Dup of it
            finally:
                _job_comm = comm  # a rebuild without ULFM starts from what the user gave
            if survivors.agree(shrunk, error is None):
                return survivors.lost_ranks(before, shrunk), survivors.new_ranks(before, shrunk)
            _abandon()  # where init() succeeded: the others did not, build again together
            if error is None or isinstance(error, _mpi.load().Exception):
                # This rank only saw the consequence (an interrupted collective); the cause
                # is raised on the rank where it happened.
                error = MpitrainInternalError("rebuilding the job over the survivors failed "
                                              f"on another rank ({error or 'its init failed'})")
    finally:
        if current is not before:
            current.Free()  # init() works on its own duplicate


def _abandon() -> None:
    """shutdown() when the other ranks will not shut down with us (see Engine.abandon)."""
    global _engine
    with _lock:
        running, _engine = _engine, None
    if running is None:
        return
    try:
        running.abandon()
    finally:
        registry.forget_all()
        runtime.stop()


def engine() -> Engine:
    """The running engine, or the not-initialised ValueError."""
    current = _engine
    if current is None:
        raise not_initialized()
    return current


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank must call this, in the same order.

    Returns:
        The registered ProcessSet (the one passed in, now with an id).

    Raises:
        ValueError: the ranks are out of range, or the set is already registered.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps!r} is already registered")
    running = engine()
    ranks = ps.resolve_ranks()
    size = runtime.size()
    bad = [r for r in ranks if not 0 <= r < size]
    if bad or not ranks:
        raise ValueError(f"process set ranks {ranks} must be non-empty and within 0..{size - 1}")
    request = Request(name=running.next_name(0, Kind.ADD_SET), kind=Kind.ADD_SET, entries=[],
                      payload=tuple(ranks))
    registry.remember(ps, running.submit(request).wait(), ranks)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Retire a process set; every rank must call this, in the same order.

    Returns:
        True once removed; False when it was not registered.

    Raises:
        ValueError: an attempt to remove the global process set.
    """
    set_id = process_set.process_set_id
    if set_id == 0:
        raise ValueError("the global process set cannot be removed")
    if set_id is None:
        return False
    running = engine()
    request = Request(name=running.next_name(0, Kind.REMOVE_SET), kind=Kind.REMOVE_SET,
                      entries=[], payload=set_id)
    try:
        running.submit(request).wait()
    except ValueError:
        return False
    registry.forget(process_set)
    return True


__all__ = ["add_process_set", "engine", "init", "on_rebuild", "rebuild", "remove_process_set",
           "shutdown"]
