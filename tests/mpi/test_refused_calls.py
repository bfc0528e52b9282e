"""A call refused at the call on some ranks (bad arguments there) fails at once everywhere.

The rank whose arguments are wrong raises ValueError/TypeError naming the value; before, the
ranks whose call went through waited for it for ever (or until the stall shutdown, off by
default), and the unnamed collectives after it paired with the wrong calls.  Now the refusal
is negotiated like a request, so every other rank's call fails with an
``MpitrainInternalError`` that names the rank and its reason, and the next unnamed collective
of the same kind pairs up again.  Found by tests/mpi/properties_bad_input.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpitrain import collectives
from mpitrain.core.errors import MpitrainInternalError

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
MPI_CONFIGS = ("np2", "np3")
LAST = SIZE - 1


def _next_unnamed_of_each_kind_works() -> None:
    assert collectives.broadcast(np.full(1, RANK), root_rank=LAST).tolist() == [LAST]
    assert collectives.alltoall(np.full(SIZE, RANK))[0].tolist() == list(range(SIZE))
    assert collectives.allgather(np.full(1, RANK)).tolist() == list(range(SIZE))
    assert collectives.allreduce(np.ones(1), op=collectives.Sum).tolist() == [SIZE]


@pytest.mark.parametrize(("call", "mistake", "reason"), [
    (lambda bad: collectives.broadcast(np.ones(2), root_rank=SIZE if bad else 0),
     ValueError, f"root_rank={SIZE} is not a rank of the process set"),
    (lambda bad: collectives.alltoall(np.ones(SIZE), splits=[SIZE + 1] + [0] * LAST
                                      if bad else None),
     ValueError, "must have"),
    (lambda bad: collectives.allgather([1.0, 2.0] if bad else np.ones(2)),
     TypeError, "tensor must be"),
    (lambda bad: collectives.allreduce(np.ones(2), prescale_factor="2" if bad else 1.0),
     TypeError, "prescale_factor must be a number"),
], ids=["broadcast-root", "alltoall-splits", "allgather-list", "allreduce-scale"])
def test_one_ranks_mistake_fails_every_rank_at_once(hvd, call, mistake, reason):
    started = time.monotonic()
    if RANK == LAST:
        with pytest.raises(mistake, match=reason):
            call(True)
    else:
        with pytest.raises(MpitrainInternalError) as failed:
            call(False)
        message = str(failed.value)
        assert f"was refused at the call on rank {LAST} (rank {LAST}: " in message, message
        assert reason in message, message
    # Not the stall shutdown (off) nor a deadlock (10 s): the refusal itself.
    assert time.monotonic() - started < 8.0
    _next_unnamed_of_each_kind_works()


def test_a_mistake_every_rank_makes_is_raised_on_every_rank(hvd):
    with pytest.raises(ValueError, match=f"root_rank={SIZE} is not a rank"):
        collectives.broadcast(np.ones(2), root_rank=SIZE, name="everyone.wrong")
    _next_unnamed_of_each_kind_works()
    # The refusals were negotiated away together: the name is free again.
    assert collectives.broadcast(np.full(1, RANK), root_rank=0,
                                 name="everyone.wrong").tolist() == [0]
