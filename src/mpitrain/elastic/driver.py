"""The elastic loop: run the user's training function, and after a failure roll back, rebuild
the job over the survivors and go again (Horovod's ``run_fn`` / ``hvd.elastic.run``).

One round: ``state.sync()`` (every rank takes rank 0's state), then ``func(state)``.  When a
collective fails with :class:`HorovodInternalError` (a peer died, and with ULFM every survivor
hears of it), each survivor restores its last commit, the job is rebuilt over the ranks still
alive (:func:`mpitrain.session.rebuild`), the state's reset callbacks run with the new
``size()``, and the next round begins.  A :class:`HostsUpdatedInterrupt` (raised by
``commit()``) resets without a restore.

Limits (``mpitrainrun --min-np N --reset-limit R``, or ``MPITRAIN_ELASTIC_MIN_NP`` /
``MPITRAIN_ELASTIC_RESET_LIMIT``): when fewer than N ranks survive, or after R recoveries, every
survivor raises :class:`ElasticLimitError` naming the lost ranks and their hosts, and the job
ends.  Each round records which host every world rank runs on, for that message.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .. import collectives, session
from ..core import elastic_control, failure, runtime
from ..core.errors import (
    ElasticLimitError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    carries_collective_failure,
)
from .state import State

R = TypeVar("R")

# World rank -> host, as of the last round's start (for naming what was lost).
_hosts: dict[int, str] = {}
_resets = 0


def _record_hosts() -> None:
    """Every rank's MPI_COMM_WORLD rank and host, gathered at the start of a round."""
    from mpi4py import MPI  # mpi4py.MPI starts MPI: imported only once training runs

    pairs = collectives.allgather_object((MPI.COMM_WORLD.Get_rank(), MPI.Get_processor_name()),
                                         name="elastic.hosts")
    _hosts.clear()
    _hosts.update(dict(pairs))
    _tell_driver("roster", hosts={str(r): h for r, h in sorted(_hosts.items())})


def _tell_driver(event: str, **fields: Any) -> None:
    """Rank 0 records an event for mpitrainrun's elastic driver, when one runs the job."""
    directory = runtime.state().config.elastic_control_dir
    if directory and runtime.rank() == 0:
        elastic_control.append_event(directory, event, **fields)


def _check_limits(lost: list[int], before: int) -> None:
    """End the job on every survivor (same inputs everywhere) once a limit is passed."""
    cfg = runtime.state().config
    size = runtime.size()
    hosts = sorted({_hosts.get(r, "?") for r in lost})
    what = f"lost world rank(s) {lost} on host(s) {hosts}" if lost else "reset"
    if cfg.elastic_min_np and size < cfg.elastic_min_np:
        raise ElasticLimitError(f"mpitrain elastic: {what}; {size} of {before} ranks remain, "
                                f"fewer than --min-np {cfg.elastic_min_np}: ending the job")
    if cfg.elastic_reset_limit and _resets > cfg.elastic_reset_limit:
        raise ElasticLimitError(f"mpitrain elastic: {what}; that is recovery {_resets}, past "
                                f"--reset-limit {cfg.elastic_reset_limit}: ending the job")


def rebuild_job() -> None:
    """Rebuild the job over the ranks still alive, and say so on the new rank 0; end it when
    a limit is passed."""
    global _resets
    started = time.monotonic()
    before = runtime.size()
    lost = session.rebuild()
    _resets += 1
    _tell_driver("lost", ranks=lost, hosts=[_hosts.get(r, "?") for r in lost],
                 size=runtime.size())
    _check_limits(lost, before)
    if runtime.rank() == 0:
        gone = (f"lost world rank(s) {lost} on host(s) "
                f"{sorted({_hosts.get(r, '?') for r in lost})}; " if lost else "")
        sys.stderr.write(f"mpitrain elastic: {gone}continuing on {runtime.size()} of {before} "
                         f"ranks (rebuilt in {1e3 * (time.monotonic() - started):.0f} ms)\n")
        sys.stderr.flush()


def run_fn(func: Callable[..., R], reset: Callable[[], None]) -> Callable[..., R]:
    """Wrap ``func(state, *args, **kwargs)`` in the elastic loop, with ``reset()`` rebuilding
    the job between rounds."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(f"{getattr(func, '__name__', func)!r}: the first argument of an "
                            f"elastic function must be an elastic State, not "
                            f"{type(state).__name__}")
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()  # back to the last commit: the failed step may be half done
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                if runtime.is_initialized() and runtime.state().config.elastic_control_dir:
                    stop_for_new_hosts(state)
                skip_sync = interrupt.skip_sync
            except RuntimeError as exc:
                # After the two above (both are RuntimeErrors too): a failed collective that
                # torch's DDP (through the torch.distributed backend) re-raised as its own
                # RuntimeError is the same failure.
                if not carries_collective_failure(str(exc)):
                    raise
                state.restore()
                skip_sync = False
            reset()
            state.on_reset()

    return wrapper


def stop_for_new_hosts(state: State) -> None:
    """End this job at the commit just made, so that mpitrainrun starts it again on the hosts
    its discovery script now lists (every rank, together: the interrupt was broadcast).

    The job grows by a restart, not by spawning ranks into it (``MPI_Comm_spawn`` onto the
    new hosts, then merging them into a communicator that may have survived ULFM shrinks):
    a restart works the same under every MPI and launcher (srun, MPICH, Open MPI with and
    without ULFM) and costs seconds at a commit point.  Rank 0 writes the commit to the state
    file, tells the driver, and every rank exits with status 0; the restarted job resumes from
    that commit (:func:`resume_from_state_file`).
    """
    state.write_state_file()
    _tell_driver("stopping", reason="hosts updated", size=runtime.size())
    if runtime.rank() == 0:
        sys.stderr.write(f"mpitrain elastic: the hosts changed; stopping at this commit "
                         f"(size {runtime.size()}) so that mpitrainrun restarts the job on "
                         "them\n")
        sys.stderr.flush()
    session.shutdown()
    raise SystemExit(0)


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate a training function so that it survives the loss of ranks.

    ``func``'s first argument is an elastic :class:`State` (``TorchState``, ``ObjectState``);
    every rank calls the decorated function with its own state.  Collectives belong inside
    ``func``, not in the call that starts it: a rebuilt job re-enters ``func`` after syncing.

    Warning:
        Survivors continue in the same processes only where the MPI library has ULFM (Open
        MPI 5: ``mpirun --with-ft ulfm``); elsewhere a dead rank still ends the job.
    """
    @functools.wraps(func)
    def round_(state: State, *args: Any, **kwargs: Any) -> R:
        _record_hosts()  # which host each rank is on, to name them if they are lost
        return func(state, *args, **kwargs)

    rounds = run_fn(round_, rebuild_job)

    @functools.wraps(func)
    def first(state: State, *args: Any, **kwargs: Any) -> R:
        resume_from_state_file(state)
        # An error that escapes on one rank only now ends that rank, not the job: still set
        # when the error reaches the excepthook, cleared only on a normal return.
        failure.elastic_training(True)
        result = rounds(state, *args, **kwargs)
        failure.elastic_training(False)
        return result

    return first


def resume_from_state_file(state: State) -> None:
    """Restart mode: rank 0 loads the last commit a previous run of the job wrote (the first
    sync then gives it to every rank).  Nothing happens without a state file."""
    if not runtime.is_initialized():
        return
    path = runtime.state().config.elastic_state_file
    if not path or runtime.rank() != 0 or not os.path.exists(path):
        return
    with open(path, "rb") as f:
        state.load_snapshot(pickle.load(f))  # noqa: S301 - written by this job's rank 0
    sys.stderr.write(f"mpitrain elastic: resuming from the commit in {path}\n")
    sys.stderr.flush()


__all__ = ["rebuild_job", "run", "run_fn"]
