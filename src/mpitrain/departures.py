"""Where this process stands in mpitrain's life, and how ``init()`` starts without hanging on a
rank that has already ended.

``init()`` is collective: its first collective waits until every rank has called it.  A rank
whose program ends before it ever calls ``init()`` (``sys.exit()`` on a missing file, the end
of a script whose ``if`` took the wrong branch on one host) never will, and MPI has no way to
tell the others: its ``MPI_Finalize`` waits for them, they wait for it, and the job hangs
(Open MPI 5.0.11, seen with 2 ranks).  So:

* ``init()`` begins with :func:`gate`, a *non-blocking* barrier over MPI_COMM_WORLD polled
  together with a probe for :data:`TAG` messages;
* a rank that ends while it is still :data:`Phase.BEFORE` ``init()`` sends every other rank one
  small :data:`TAG` message naming itself (:func:`announce`, called at exit by
  :mod:`mpitrain.failure`), starting MPI for that if its program never did (otherwise the
  others' ``MPI_Init`` would wait for it inside Open MPI);
* a rank in the gate that receives one raises :class:`~mpitrain.errors.MpitrainInternalError`
  naming the rank that left, and the job is aborted as for any uncaught error.

Once the gate has passed, every rank is inside ``init()``: a rank that then leaves it early
(an exception, ``sys.exit()`` from a signal handler) ends the whole job instead
(:mod:`mpitrain.failure`), since the others wait in ``init()``'s blocking collectives.

Costs: the gate adds one barrier and at most 10 ms of polling to ``init()``; the message is
sent only by a process that imported mpitrain, ran under an MPI launcher with more than one
rank and ended without ever calling ``init()`` (p - 1 messages of about 80 bytes).  The tag
travels on MPI_COMM_WORLD: a program of its own that receives on MPI_COMM_WORLD with
``MPI.ANY_TAG`` after a rank left could see one.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import time
from typing import Any

from .errors import MpitrainInternalError

# The tag of the "this rank has ended before init()" message on MPI_COMM_WORLD: "mpit" in
# ASCII, within the 2**15 - 1 every MPI library must allow (Open MPI's upper bound is 2**31-1).
TAG = 0x7074
SEND_SECONDS = 5.0  # how long the departing rank helps its messages along before it goes on
_POLL_MAX_S = 0.01


class Phase(enum.Enum):
    """Where this process is in mpitrain's life (one value per process)."""

    BEFORE = "before init()"  # never started: a departure is announced to the others
    STARTING = "in init()"  # past the gate: the others wait in init()'s collectives
    FAILED = "after a failed init()"  # left init() early: the others may still wait there
    RUNNING = "running"  # init() returned; the engine's shutdown tells the others
    STOPPED = "shut down"  # a shutdown (or an agreed failure) that every rank took part in


_phase = Phase.BEFORE
_pending: list[Any] = []  # requests and buffers MPI may still use after we stopped waiting


def phase() -> Phase:
    return _phase


def enter(new: Phase) -> None:
    """Record where this process stands (called by the runtime and the session)."""
    global _phase
    _phase = new


def gate(MPI: Any) -> None:
    """Return once every rank of MPI_COMM_WORLD has reached this point (collective).

    Raises:
        MpitrainInternalError: a rank ended before calling ``init()``; the message names it.
    """
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    request = world.Ibarrier()
    status = MPI.Status()
    pause = 1e-4
    while not request.Test():
        if world.Iprobe(MPI.ANY_SOURCE, TAG, status):
            data = bytearray(status.Get_count(MPI.BYTE))
            world.Recv([data, MPI.BYTE], source=status.Get_source(), tag=TAG)
            # The barrier never completes now; MPI may hold on to it until the abort.
            _pending.append(request)
            raise MpitrainInternalError(_left_message(_decode(bytes(data), status.Get_source()),
                                                      world.Get_rank()))
        time.sleep(pause)  # the others may take minutes to get here: poll without spinning
        pause = min(2 * pause, _POLL_MAX_S)


def announce(MPI: Any) -> None:
    """Tell every other rank of MPI_COMM_WORLD that this one has ended before ``init()``.

    Not collective; returns after the messages went out, or after :data:`SEND_SECONDS` (a
    peer that has not started MPI yet receives them once it does: MPI_Finalize keeps them
    moving).
    """
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        return
    note = bytearray(json.dumps({"rank": rank, "size": size, "host": socket.gethostname(),
                                 "pid": os.getpid()}).encode())
    requests = [world.Isend([note, MPI.BYTE], dest=peer, tag=TAG)
                for peer in range(size) if peer != rank]
    deadline = time.monotonic() + SEND_SECONDS
    while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
        time.sleep(1e-3)
    _pending.append((note, requests))


def _decode(data: bytes, source: int) -> dict[str, Any]:
    try:
        note = json.loads(data)
        if isinstance(note, dict):
            return note
    except ValueError:
        pass
    # Not ours after all (a program of its own used our tag): still a rank that is not here.
    return {"rank": source}


def _left_message(note: dict[str, Any], me: int) -> str:
    where = ", ".join(f"{k} {note[k]}" for k in ("host", "pid") if k in note)
    size = f" of {note['size']}" if "size" in note else ""
    return (f"rank {note.get('rank', '?')}{size}{f' ({where})' if where else ''} ended before "
            f"calling mpitrain.init() (sys.exit(), the end of its script, or an uncaught error "
            f"with MPITRAIN_ABORT_ON_ERROR=0), while rank {me} waited for it in init(); "
            "every rank must call init()")


__all__ = ["TAG", "Phase", "announce", "enter", "gate", "phase"]
