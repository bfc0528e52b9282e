"""join() interleaved with every collective: each finishes or fails clearly, none hangs.

One rank joins early while the others go on with a collective (named or unnamed, twice so the
second run is a cache hit), then join too; afterwards every collective, named and unnamed, must
run on every rank with correct values.  Before the name counters were aligned at join, the
unnamed collectives after a join got different names on different ranks and the job hung.

A deadlock that no code path can end (ranks submit different names and all wait) must fail
every rank within seconds with a message naming the tensors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from mpi4py import MPI

# Read at init(), which the session fixture runs after this module is imported.
DEADLOCK_S = 2.0
os.environ["MPITRAIN_DEADLOCK_TIME_SECONDS"] = str(DEADLOCK_S)

MPI_CONFIGS = ("np2", "np4")  # an odd size adds no code path to join; CI time is short
RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()

# What the non-joined ranks may still do while some rank has joined (Horovod's rule).
ALLOWED_DURING_JOIN = {"allreduce", "allreduce_async", "grouped_allreduce", "barrier"}


def _input(rank: int) -> torch.Tensor:
    return torch.arange(2 * SIZE, dtype=torch.float32).reshape(SIZE, 2) + 10 * (rank + 1)


def _run(hvd: Any, op: str, name: str | None, ranks: list[int]) -> Callable[[], None]:
    """A thunk running ``op`` and checking its result; ``ranks`` take part with data."""
    x = _input(RANK)
    present = [_input(r) for r in ranks]
    average = sum(present) / SIZE  # joined ranks count with zeros

    def check() -> None:
        if op == "allreduce":
            torch.testing.assert_close(hvd.allreduce(x, name=name), average)
        elif op == "allreduce_async":
            torch.testing.assert_close(hvd.synchronize(hvd.allreduce_async(x, name=name)),
                                       average)
        elif op == "grouped_allreduce":
            got = hvd.grouped_allreduce([x, 2 * x], name=name)
            torch.testing.assert_close(got[1], 2 * average)
        elif op == "barrier":
            hvd.barrier()
        elif op == "allgather":
            torch.testing.assert_close(hvd.allgather(x, name=name), torch.cat(present))
        elif op == "grouped_allgather":
            got = hvd.grouped_allgather([x, x[:1]], name=name)
            torch.testing.assert_close(got[1], torch.cat([p[:1] for p in present]))
        elif op == "broadcast":
            torch.testing.assert_close(hvd.broadcast(x, root_rank=SIZE - 1, name=name),
                                       _input(SIZE - 1))
        elif op == "alltoall":
            got = hvd.alltoall(x, name=name)
            torch.testing.assert_close(got, torch.stack([p[RANK] for p in present]))
        elif op == "reducescatter":
            got = hvd.reducescatter(x, name=name, op=hvd.Sum)
            torch.testing.assert_close(got, sum(present)[RANK:RANK + 1])
        elif op == "broadcast_object":
            assert hvd.broadcast_object({"r": RANK}, root_rank=0, name=name) == {"r": 0}
        elif op == "allgather_object":
            assert hvd.allgather_object(RANK, name=name) == list(range(SIZE))
        else:
            raise AssertionError(op)

    return check


OPS = ["allreduce", "allreduce_async", "grouped_allreduce", "barrier", "allgather",
       "grouped_allgather", "broadcast", "alltoall", "reducescatter", "broadcast_object",
       "allgather_object"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize("early", ["first", "last"])
@pytest.mark.parametrize("op", OPS)
def test_join_interleaved_with(hvd, op: str, early: str, named: bool) -> None:
    if SIZE == 1:
        pytest.skip("join needs other ranks")
    joiner = 0 if early == "first" else SIZE - 1
    others = [r for r in range(SIZE) if r != joiner]
    tag = f"{op}.{early}"
    if joiner == RANK:
        last = hvd.join()
    else:
        for repeat in range(2):  # the second time the negotiation cache answers
            name = f"during.{tag}.{repeat}" if named else None
            check = _run(hvd, op, name, others)
            if op in ALLOWED_DURING_JOIN:
                check()
            else:
                with pytest.raises(hvd.MpitrainInternalError, match="joined"):
                    check()
        last = hvd.join()
    assert last in others
    # Everyone joined: every collective runs again, with the same automatic names everywhere.
    for after in OPS:
        _run(hvd, after, f"after.{tag}.{after}" if named else None, list(range(SIZE)))()


@pytest.mark.timeout(60)
def test_join_alone_then_objects(hvd) -> None:
    """The reported pattern: objects exchanged after one rank joined early (was a hang)."""
    if RANK == 0:
        hvd.join()
    else:
        for _ in range(3):
            hvd.allreduce(torch.ones(4))
        with pytest.raises(hvd.MpitrainInternalError):
            hvd.broadcast_object(1, 0)
        hvd.join()
    assert hvd.broadcast_object({"a": RANK}, 0) == {"a": 0}
    assert hvd.allgather_object(RANK) == list(range(SIZE))


@pytest.mark.timeout(60)
def test_deadlock_fails_every_rank_with_the_names(hvd) -> None:
    """Each rank waits for a tensor only it submitted: nothing can ever match."""
    if SIZE == 1:
        pytest.skip("a deadlock needs two ranks")
    start = time.monotonic()
    with pytest.raises(hvd.MpitrainInternalError) as info:
        hvd.allreduce(torch.ones(3), name=f"only.on.{RANK}")
    waited = time.monotonic() - start
    message = str(info.value)
    assert "deadlock" in message
    for r in range(SIZE):
        assert f"'only.on.{r}'" in message
        assert f"submitted by ranks [{r}]" in message
    assert DEADLOCK_S <= waited < DEADLOCK_S + 20
    # The engine goes on: the next collective works everywhere.
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), name="after.deadlock"),
                               torch.ones(2))


@pytest.mark.timeout(60)
def test_slow_rank_is_not_a_deadlock(hvd) -> None:
    """One rank computes longer than the deadlock time before it submits: no false alarm."""
    if RANK == 0:
        time.sleep(DEADLOCK_S * 2)  # not waiting on a handle: only computing
    got = hvd.allreduce(torch.full((2,), float(RANK)), name="slow.rank", op=hvd.Sum)
    torch.testing.assert_close(got, torch.full((2,), float(sum(range(SIZE)))))
