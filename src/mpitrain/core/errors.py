"""One error type for failures of the job, distinct from the caller's mistakes.

Caller mistakes (a bad argument, a wrong dtype) raise ``ValueError``/``TypeError`` at the call.
Failures of the job itself (a peer died, ranks disagree about a tensor, shutdown with requests
in flight) raise :class:`MpitrainInternalError`, which Horovod code catches under its own name.
"""

from __future__ import annotations


class MpitrainInternalError(RuntimeError):
    """A collective failed for a reason outside the caller's arguments on this rank."""


HorovodInternalError = MpitrainInternalError


class CollectiveMismatchError(MpitrainInternalError):
    """Ranks submitted one collective with different arguments (operation, dtype, shape, reduce
    op, root rank, ...), or one that cannot run while some ranks have joined: raised on every
    rank of the set.  Horovod calls this a precondition error; mpitrain's TensorFlow face raises
    it as a ``tf.errors.FailedPreconditionError`` (see ``mpitrain.tensorflow.errors``)."""

# What a failed collective's message says once a framework has wrapped it in its own error
# (a TensorFlow OpError, the RuntimeError torch's DDP raises from a failed future).
_FAILURE_MARKS = ("MpitrainInternalError", "CollectiveMismatchError", "mpitrain engine failed",
                  "MPI_ERR_PROC_FAILED", "MPI_ERR_REVOKED")


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 1-3, 5``: runs collapsed, so an error about a 1,024-rank job stays
    one line (``ranks`` sorted)."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def carries_collective_failure(message: str) -> bool:
    """Whether ``message`` is a framework's wrapping of a failed mpitrain collective."""
    return any(mark in message for mark in _FAILURE_MARKS)


class AdasumTypeError(TypeError, RuntimeError):
    """``op=Adasum`` on a tensor that is not floating point.

    A caller's mistake, so a ``TypeError``; also a ``RuntimeError`` because that is what
    Horovod's callers catch (its reducescatter refuses Adasum with one, whatever the dtype).
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: elastic training resets at its next commit, without a restore.

    ``skip_sync`` is True when hosts were only removed: the survivors' state is already the
    same everywhere, so the reset need not broadcast it again (Horovod's meaning).
    """

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class ElasticLimitError(RuntimeError):
    """An elastic job lost more than it may (below ``--min-np``, or past ``--reset-limit``):
    raised on every survivor, so the job ends with this message instead of training on."""


def not_initialized() -> ValueError:
    """The error every runtime query raises before init()."""
    return ValueError("mpitrain has not been initialized; call mpitrain.init() first.")
