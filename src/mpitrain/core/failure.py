"""How a rank that dies of an uncaught exception reports it and ends the whole job, and how a
rank that ends outside a running session (before or in ``init()``) does not leave the others
waiting for it (:func:`install_import_time_hooks`, with :mod:`mpitrain.core.departures`).

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

import atexit
import contextlib
import faulthandler
import hashlib
import io
import os
import sys
import time
import traceback
from typing import Any

from . import _mpi, config, departures, launchers
from .departures import Phase
from .errors import ranks_text
from .topology import Topology

AGREE_SECONDS = 3.0  # how long a failing rank waits to learn whether every rank failed
SETTLE_SECONDS = 2.0  # how long every rank waits for the others to print before the abort
_DIGEST = 8

_comm: Any = None
_topology: Topology | None = None
_elastic = {"running": False}  # inside hvd.elastic.run: a rank that fails alone leaves
_pending: list[Any] = []  # buffers of a request given up on: MPI may still write into them


def arm(comm: Any, topology: Topology) -> None:
    """Duplicate ``comm`` for the agreement; collective, called by every rank at ``init()``."""
    global _comm, _topology
    _comm, _topology = comm.Dup(), topology


# ------------------------------------------------------------------ outside a session
_installed_in: int | None = None  # the process that imported mpitrain (not a forked child)
# Whether the program is known to end with a non-zero status: sys.exit(n != 0), or an
# uncaught exception, and how it ends ("sys.exit(3)", "raised KeyError"), for the others'
# message.  atexit handlers are not told the status, so it is noted on the way.
_failing: dict[str, Any] = {"known": False, "how": ""}
# How long a rank ending with a non-zero status before init() waits in MPI_Init for the others
# (to tell them, see _at_exit) before it ends with status 1 and leaves it to the launcher.
FAILING_START_WAIT_S = 30.0


def install_import_time_hooks() -> None:
    """At ``import mpitrain``: make a rank that ends outside a running session end the job
    (or tell the others) instead of leaving them waiting for it.

    Two ways out are covered, in the process that imported mpitrain (a child forked later
    inherits the hooks but has no rank of its own, and leaves them alone):

    * an uncaught exception (``sys.excepthook``, :func:`handle_outside_session`): before
      ``init()`` while MPI runs, or in a failed ``init()``, the job is aborted naming the rank.
      When the user's script has started MPI itself (``from mpi4py import MPI`` starts it at
      import) and one rank fails before ``init()`` (a missing file on one host, say), the
      other ranks wait in ``init()`` and the failing rank's own exit waits in
      ``MPI_Finalize`` for them: every rank hangs (seen 2026-11-27 with 2 ranks; mpirun's
      "process exited with non-zero status" never comes, since none exits);
    * any other end of the program (``sys.exit()``, the end of the script; an ``atexit``
      handler, :func:`_at_exit`): before ``init()`` the rank announces its departure to the
      others (:mod:`mpitrain.core.departures`), whose ``init()`` then fails naming it; in the
      middle of ``init()`` the job is aborted, the others waiting in its collectives.

    Nothing is done where MPI is not running and no MPI launcher started several ranks,
    after a clean ``shutdown()``, for Ctrl-C (every rank gets it), nor with
    ``MPITRAIN_ABORT_ON_ERROR=0`` (which only keeps the departure announcement).
    """
    global _installed_in
    if _installed_in is not None:
        return
    _installed_in = os.getpid()
    previous = sys.excepthook

    def abort_outside_session(exc_type: Any, exc: Any, tb: Any) -> None:
        handle_outside_session(exc_type, exc, tb, previous)

    abort_outside_session.below_mpitrain = previous  # type: ignore[attr-defined]
    sys.excepthook = abort_outside_session
    _note_exit_statuses()
    atexit.register(_at_exit)


def _note_exit_statuses() -> None:
    """Have ``sys.exit(status)`` note whether the status is non-zero, then exit as before
    (``raise SystemExit`` directly is not seen: its status counts as unknown)."""
    original = sys.exit

    def exit_noting_status(status: Any = None) -> None:
        _failing["known"] = status is not None and status != 0
        _failing["how"] = f"sys.exit({status!r})"
        original(status)

    exit_noting_status.__doc__ = original.__doc__
    sys.exit = exit_noting_status  # type: ignore[assignment]


def hook_below_ours(hook: Any) -> Any:
    """``hook``, or what it wraps if it is the import-time hook (which has nothing to do while
    a session runs): init()'s own hook must see the user's hook (or ``sys.__excepthook__``) as
    its previous one, so that a rank whose report another rank prints stays quiet."""
    return getattr(hook, "below_mpitrain", hook)


def _waiting_world() -> Any:
    """COMM_WORLD when this rank's end would leave others waiting for it, else None: MPI runs
    with more than one rank, this is the process that imported mpitrain, and it is before or
    in ``init()`` (after a clean shutdown, nobody waits)."""
    if os.getpid() != _installed_in:
        return None
    if departures.phase() not in (Phase.BEFORE, Phase.STARTING, Phase.FAILED):
        return None
    return _running_world()


def handle_outside_session(exc_type: Any, exc: Any, tb: Any, previous: Any) -> None:
    """An uncaught exception while no session runs: abort the job if others may wait for this
    rank (see :func:`install_import_time_hooks`), else hand it to ``previous``."""
    _failing["known"] = True  # Python ends with status 1 after an uncaught exception
    _failing["how"] = f"raised {exc_type.__name__}"
    world = _waiting_world()
    if world is None or issubclass(exc_type, KeyboardInterrupt) or not _abort_wanted():
        _call_quietly(previous, exc_type, exc, tb)
        return
    _write_to_the_terminal()
    _print_traceback(exc_type, exc, tb, previous)
    where = f"rank {world.Get_rank()} of {world.Get_size()}"
    if departures.phase() is Phase.BEFORE:
        _say(f"mpitrain: {where} raised {exc_type.__name__} before mpitrain.init() while MPI "
             "was running; aborting all ranks (the others would wait for this one forever).")
    else:
        _say(f"mpitrain: {where} raised {exc_type.__name__} in mpitrain.init(); aborting all "
             "ranks (the others would wait for this one forever).")
    _abort()


def _at_exit() -> None:
    """The program is ending (not by an uncaught exception that aborted the job): tell the
    others if this rank never started mpitrain, or end the job if it left ``init()`` midway."""
    if os.getpid() != _installed_in:
        return
    now = departures.phase()
    if now is Phase.BEFORE:
        MPI = _running_mpi()
        if MPI is None:
            claim = launchers.detect()
            if claim is None or claim.launcher.kind != "mpi":
                return  # no MPI job
            if _failing["how"] == f"raised {KeyboardInterrupt.__name__}":
                return  # Ctrl-C: every rank got it, and none should wait to start MPI now
            # Under an MPI launcher the others' MPI_Init waits for this process to start MPI
            # (Open MPI counts a rank that ends with status 0 without it as finished): start
            # it, so that they get as far as init(), where the announcement reaches them.  With
            # a non-zero status the launcher should end the job itself, but Open MPI 5 does not
            # always (CI saw rank 0 wait in MPI_Init for 150 s after rank 1 raised at import):
            # so that rank tells the others too, giving them FAILING_START_WAIT_S to start MPI,
            # and past that ends with status 1 for the launcher to act on.
            MPI = _start_mpi(FAILING_START_WAIT_S if _failing["known"] else None)
        with contextlib.suppress(Exception):  # an MPI that broke must not stop the exit
            departures.announce(MPI, str(_failing["how"]))
        return
    if now in (Phase.STARTING, Phase.FAILED):
        world = _waiting_world()
        if world is None or not _abort_wanted():
            return
        _say(f"mpitrain: rank {world.Get_rank()} of {world.Get_size()} is ending in "
             "mpitrain.init() (sys.exit(), or an error caught and left behind); aborting all "
             "ranks (the others would wait for this one forever).")
        _abort()


def _start_mpi(limit_s: float | None) -> Any:
    """Start MPI for the departure announcement; with ``limit_s``, a C-level timer (it needs no
    GIL, which MPI_Init holds while it waits) ends the process with status 1 if MPI has not
    started by then."""
    if limit_s is None:
        return _mpi.load()
    with open(os.devnull, "w") as quiet:
        faulthandler.dump_traceback_later(limit_s, exit=True, file=quiet)
        try:
            return _mpi.load()
        finally:
            faulthandler.cancel_dump_traceback_later()


def _running_mpi() -> Any:
    """The mpi4py.MPI module if this process has started MPI (and not finalized it)."""
    MPI = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            return MPI
    except Exception:  # noqa: BLE001 - a broken MPI: nothing to tell anyone through it
        return None
    return None


def _running_world() -> Any:
    """MPI's COMM_WORLD if mpi4py has started MPI and it has more than one rank, else None."""
    MPI = _running_mpi()
    try:
        if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
            return MPI.COMM_WORLD
    except Exception:  # noqa: BLE001 - a broken MPI: let the plain exit happen
        return None
    return None


def _abort_wanted() -> bool:
    try:
        return bool(config.load().abort_on_error)
    except Exception:  # noqa: BLE001 - a bad setting elsewhere must not keep a rank hanging
        return True


def elastic_training(running: bool) -> None:
    """Say whether elastic training (``hvd.elastic.run``) is under way: there, a rank that
    fails alone leaves the job instead of aborting it, and the others go on."""
    _elastic["running"] = running


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
        if _elastic["running"]:
            # The program ends normally from here: its shutdown at exit tells the others,
            # which rebuild the job without this rank (mpitrain.session.rebuild) and go on.
            _say(f"mpitrain: {where} raised {name} in elastic training; this rank leaves the "
                 "job, the others go on without it.")
            return
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
