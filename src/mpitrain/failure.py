"""How a rank that dies of an uncaught exception reports it and ends the whole job.

A mismatch found by negotiation is raised on every rank, and so is a caller's mistake that
every rank makes: printed by each, p ranks give p chained tracebacks of one message.  So the
ranks that fail first agree, for at most :data:`AGREE_SECONDS`, on who failed with what: of
the ranks that raised the same exception type with the same message, the lowest prints the
traceback and names the others, which print one line each.  If some rank does not fail within
that time (one rank's own bug; the others wait in a collective), nobody waits longer: each
failing rank prints its own traceback, as before, and aborts the job.

The agreement is one non-blocking allgather of an 8-byte digest on a communicator of its own
(duplicated at ``init()``, so it can never match anyone's collective), polled until a deadline:
it cannot hang, and the job ends within seconds either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import sys
import time
import traceback
from typing import Any

from . import _mpi, config
from .errors import ranks_text
from .topology import Topology

AGREE_SECONDS = 3.0  # how long a failing rank waits to learn whether every rank failed
SETTLE_SECONDS = 2.0  # how long every rank waits for the others to print before the abort
_DIGEST = 8

_comm: Any = None
_topology: Topology | None = None
_pending: list[Any] = []  # buffers of a request given up on: MPI may still write into them


def arm(comm: Any, topology: Topology) -> None:
    """Duplicate ``comm`` for the agreement; collective, called by every rank at ``init()``."""
    global _comm, _topology, _initialised_once
    _comm, _topology, _initialised_once = comm.Dup(), topology, True


# ------------------------------------------------------------------ before init()
_initialised_once = False  # after init(), runtime's own hook decides (and after shutdown, no one)
_before_init_installed = False


def install_before_init_hook() -> None:
    """At ``import mpitrain``: an uncaught exception before ``init()`` ends a running MPI job.

    When the user's script has started MPI itself (``from mpi4py import MPI`` starts it at
    import) and one rank fails before ``init()`` (a missing file on one host, say), the other
    ranks wait in ``init()``'s first collective, and the failing rank's own exit waits in
    ``MPI_Finalize`` for them: every rank hangs (seen 2026-11-27 with 2 ranks; mpirun's
    "process exited with non-zero status" never comes, since none exits). Where MPI is not
    running yet the exit is plain and mpirun ends the job itself, so nothing is done then; nor
    once ``init()`` has run (its own hook takes over), nor for Ctrl-C (every rank gets it), nor
    with ``MPITRAIN_ABORT_ON_ERROR=0``.
    """
    global _before_init_installed
    if _before_init_installed:
        return
    _before_init_installed = True
    previous = sys.excepthook

    def abort_before_init(exc_type: Any, exc: Any, tb: Any) -> None:
        world = None if _initialised_once else _running_world()
        if world is None or issubclass(exc_type, KeyboardInterrupt) or not _abort_wanted():
            _call_quietly(previous, exc_type, exc, tb)
            return
        _write_to_the_terminal()
        _print_traceback(exc_type, exc, tb, previous)
        _say(f"mpitrain: rank {world.Get_rank()} of {world.Get_size()} raised "
             f"{exc_type.__name__} before mpitrain.init() while MPI was running; aborting all "
             "ranks (the others would wait for this one forever).")
        _abort()

    abort_before_init.below_mpitrain = previous  # type: ignore[attr-defined]
    sys.excepthook = abort_before_init


def hook_below_ours(hook: Any) -> Any:
    """``hook``, or what it wraps if it is the before-init hook (which has nothing to do after
    ``init()``): init()'s own hook must see the user's hook (or ``sys.__excepthook__``) as its
    previous one, so that a rank whose report another rank prints stays quiet."""
    return getattr(hook, "below_mpitrain", hook)


def _running_world() -> Any:
    """MPI's COMM_WORLD if mpi4py has started MPI and it has more than one rank, else None."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return None
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            return MPI.COMM_WORLD
    except Exception:  # noqa: BLE001 - a broken MPI: let the plain exit happen
        return None
    return None


def _abort_wanted() -> bool:
    try:
        return bool(config.load().abort_on_error)
    except Exception:  # noqa: BLE001 - a bad setting elsewhere must not keep a rank hanging
        return True


def disarm() -> None:
    """Free the agreement's communicator (at ``shutdown()``; every rank calls it)."""
    global _comm, _topology
    comm, _comm, _topology = _comm, None, None
    if comm is not None:
        with contextlib.suppress(Exception):  # best effort at teardown
            comm.Free()


def report_and_abort(exc_type: Any, exc: Any, tb: Any, previous: Any) -> None:
    """Print ``exc`` once per distinct message across the failing ranks, then abort the job.

    ``previous`` is the excepthook that was installed before mpitrain's; a custom one is
    always called, the default one only where this rank prints the traceback.
    """
    _write_to_the_terminal()
    comm, topo = _comm, _topology
    if comm is None or topo is None:
        _print_traceback(exc_type, exc, tb, previous)
        _abort()
        return
    where = f"rank {topo.rank} of {topo.size} (host {topo.hostname})"
    name = exc_type.__name__
    digest = hashlib.blake2b(f"{exc_type.__module__}.{exc_type.__qualname__}: {exc}".encode(),
                             digest_size=_DIGEST).digest()
    everyone = _gather(comm, digest, topo.size, AGREE_SECONDS)
    if everyone is None:  # some rank is still running: report alone, at once
        _print_traceback(exc_type, exc, tb, previous)
        _say(f"mpitrain: {where} raised {name}; aborting all ranks.")
        _abort()
        return
    same = [r for r, d in enumerate(everyone) if d == digest]
    if same[0] == topo.rank:
        _print_traceback(exc_type, exc, tb, previous)
        others = (f"; so did {ranks_text(same[1:])}, with the same message (not printed again)"
                  if len(same) > 1 else "")
        _say(f"mpitrain: {where} raised {name}{others}; every rank failed, aborting all ranks.")
    else:
        if previous is not sys.__excepthook__:
            _call_quietly(previous, exc_type, exc, tb)
        _say(f"mpitrain: {where} raised the same {name} as rank {same[0]} (printed there); "
             "aborting all ranks.")
    # Every rank is here: let each finish printing, then one rank ends the job (one banner).
    _wait(comm.Ibarrier(), SETTLE_SECONDS)
    if topo.rank == 0:
        _abort()
    time.sleep(SETTLE_SECONDS)  # rank 0's abort normally ends this process here
    _abort()


def _gather(comm: Any, digest: bytes, size: int, seconds: float) -> list[bytes] | None:
    """Every rank's digest, or None if not every rank contributed within ``seconds``."""
    MPI = _mpi.load()
    send, recv = bytearray(digest), bytearray(_DIGEST * size)
    try:
        request = comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])
    except Exception:  # noqa: BLE001 - a broken MPI must not stop the abort
        return None
    if not _wait(request, seconds):
        _pending.append((send, recv))
        return None
    return [bytes(recv[i * _DIGEST:(i + 1) * _DIGEST]) for i in range(size)]


def _wait(request: Any, seconds: float) -> bool:
    """Poll ``request`` (polling also drives its progress) until done or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    try:
        while not request.Test():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - a failed request is as good as a late one here
        return False
    return True


def _write_to_the_terminal() -> None:
    """Point ``sys.stderr`` back at the process's own stream if a hook above ours captured it.

    torch's ``init_process_group`` wraps the excepthook it finds (ours, installed by the
    mpitrain backend's ``init()``) in one that sends ``sys.stderr`` to a ``StringIO`` while
    ours runs and prints the buffer after it returns, with rank prefixes. Ours never returns:
    it aborts the job, and the traceback died in the buffer (every rank silent, only MPI's
    abort banner; seen with Accelerate over the "mpitrain" backend, 2026-11-27). What the
    buffer already holds is written first.
    """
    captured, real = sys.stderr, sys.__stderr__
    if real is None or captured is real or not isinstance(captured, io.StringIO):
        return
    sys.stderr = real
    held = captured.getvalue()
    if held:
        real.write(held)
        real.flush()


def _print_traceback(exc_type: Any, exc: Any, tb: Any, previous: Any) -> None:
    """The previous hook's report; the default one without a cause that repeats ``exc``.

    A collective's error is raised in the engine's thread and raised again, from it, in the
    caller's: the cause has no traceback and the same message, so printing it adds a copy.
    """
    cause = getattr(exc, "__cause__", None)
    if (previous is sys.__excepthook__ and cause is not None and cause.__traceback__ is None
            and str(cause) == str(exc)):
        traceback.print_exception(exc_type, exc, tb, chain=False)
        return
    _call_quietly(previous, exc_type, exc, tb)


def _call_quietly(hook: Any, exc_type: Any, exc: Any, tb: Any) -> None:
    try:
        hook(exc_type, exc, tb)
    except Exception:  # noqa: BLE001 - never let printing stop the abort
        traceback.print_exception(exc_type, exc, tb)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    sys.stdout.flush()


def _abort() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _mpi.load().COMM_WORLD.Abort(1)
