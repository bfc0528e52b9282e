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
  :mod:`mpitrain.core.failure`), starting MPI for that if its program never did (otherwise the
  others' ``MPI_Init`` would wait for it inside Open MPI);
* a rank in the gate that receives one raises :class:`~mpitrain.core.errors.MpitrainInternalError`
  naming the rank that left, and the job is aborted as for any uncaught error.

Once the gate has passed, every rank is inside ``init()``: a rank that then leaves it early
(an exception, ``sys.exit()`` from a signal handler) ends the whole job instead
(:mod:`mpitrain.core.failure`), since the others wait in ``init()``'s blocking collectives.

A rank that never ends and never comes (a script stuck before ``init()`` on one host, a data
load that takes an hour there) is bounded only by a **start timeout** (``MPITRAIN_START_TIMEOUT``,
``mpitrainrun --start-timeout``; off by default, as a long load before ``init()`` is a
legitimate program): every rank must be in the gate within that many seconds of its process's
start.  Ranks tell rank 0 they arrived (and rank 0 tells them it did); at its deadline rank 0
names the ranks it has not heard from, to itself and to every rank that came, and each raises
that.  A rank whose deadline passes without word from rank 0 waits :data:`VERDICT_GRACE_S`
more for it when rank 0 is there (its deadline may be a little later), then raises saying
which ranks it cannot know; when rank 0 itself has not come, it says so.  The raise ends the
job as any failed ``init()`` does.  That roll call needs MPI up on the ranks that wait; ranks
whose ``MPI_Init`` waits for the late one (Open MPI's waits for every rank) are ended by
:func:`watch_mpi_start`'s watchdog instead.

Costs: the gate adds one barrier and at most 10 ms of polling to ``init()``; the message is
sent only by a process that imported mpitrain, ran under an MPI launcher with more than one
rank and ended without ever calling ``init()`` (p - 1 messages of about 80 bytes).  With a
start timeout, 2(p - 1) empty messages more, all to or from rank 0, and one forked watchdog
process per rank until its ``MPI_Init`` returns.  The tags travel on
MPI_COMM_WORLD: a program of its own that receives on MPI_COMM_WORLD with ``MPI.ANY_TAG``
after a rank left could see one.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from .errors import MpitrainInternalError, ranks_text

# The tag of the "this rank has ended before init()" message on MPI_COMM_WORLD: "mpit" in
# ASCII, within the 2**15 - 1 every MPI library must allow (Open MPI's upper bound is 2**31-1).
TAG = 0x7074
# With a start timeout: "I am in the gate" (to and from rank 0), and rank 0's verdict.
TAG_ARRIVED = TAG + 1
TAG_VERDICT = TAG + 2
# How long a rank past its start deadline waits for rank 0's verdict once rank 0 is known to be
# in the gate: rank 0's deadline counts from its own start, which may be a little later.
VERDICT_GRACE_S = 5.0
# A rank that reaches the gate after its deadline still gives the others' news this long to
# arrive before judging who is missing (messages already sent may not have been received).
LATE_ARRIVAL_S = 1.0
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
_running_hooks: list[Callable[[], None]] = []
_pending: list[Any] = []  # requests and buffers MPI may still use after we stopped waiting
# The start timeout's watchdog process and the pipe whose closing stops it, while MPI starts.
_watchdog: list[int] = []
_LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_IMPORTED = time.monotonic()


def phase() -> Phase:
    return _phase


def enter(new: Phase) -> None:
    """Record where this process stands (called by the runtime and the session); on entering
    :data:`Phase.RUNNING`, run the :func:`when_running` hooks."""
    global _phase
    _phase = new
    if new is Phase.RUNNING:
        for hook in list(_running_hooks):
            hook()


def when_running(hook: Callable[[], None]) -> None:
    """Have ``hook`` run each time ``init()`` has started mpitrain: what faces register at
    ``import mpitrain`` (torch.distributed's backend, :mod:`mpitrain.face.torch_adapters`)."""
    if hook not in _running_hooks:
        _running_hooks.append(hook)


def gate(MPI: Any, start_timeout: float = 0.0) -> None:
    """Return once every rank of MPI_COMM_WORLD has reached this point (collective).

    ``start_timeout``: seconds from this process's start by which every rank must be here
    (0: wait as long as it takes, unless a rank is known to have ended).

    Raises:
        MpitrainInternalError: a rank ended before calling ``init()``, or the start timeout
            passed with ranks missing; the message names them (or says they are unknown).
    """
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        return
    roll = _Roll(MPI, world, start_timeout) if start_timeout > 0 else None
    request = world.Ibarrier()
    status = MPI.Status()
    pause = 1e-4
    while not request.Test():
        if world.Iprobe(MPI.ANY_SOURCE, TAG, status):
            data = bytearray(status.Get_count(MPI.BYTE))
            world.Recv([data, MPI.BYTE], source=status.Get_source(), tag=TAG)
            # The barrier never completes now; MPI may hold on to it until the abort.
            _pending.append((request, roll))
            raise MpitrainInternalError(_left_message(_decode(bytes(data), status.Get_source()),
                                                      world.Get_rank()))
        if roll is not None:
            verdict = roll.check()
            if verdict is not None:
                _pending.append((request, roll))
                raise MpitrainInternalError(verdict)
        time.sleep(pause)  # the others may take minutes to get here: poll without spinning
        pause = min(2 * pause, _POLL_MAX_S)
    if roll is not None:
        roll.finish()


def watch_mpi_start() -> None:
    """Bound the wait inside ``MPI_Init`` by the start timeout (called at ``import mpitrain``).

    Open MPI's ``MPI_Init`` waits inside the library for every rank to start MPI (its exchange
    of addresses), holding Python's GIL, so a rank stuck before starting MPI keeps the others
    there, out of the gate's reach and of any Python thread's.  So, when a start timeout is set
    (``MPITRAIN_START_TIMEOUT``, ``HOROVOD_START_TIMEOUT``) and MPI is not up yet, a forked
    watchdog process (os-level calls only) is told through a pipe when this rank begins
    importing ``mpi4py.MPI`` and when that import is done.  If it began and is not done
    :data:`VERDICT_GRACE_S` past the timeout (the gate's roll call, which can name the missing
    ranks, gets the first chance once MPI is up), the watchdog says so and terminates this
    rank, and the launcher ends the job.  A process that never starts MPI is left alone.
    """
    if "mpi4py.MPI" in sys.modules or _watchdog:
        return
    if not any(v in os.environ for v in _LAUNCHER_RANK_VARIABLES):
        return  # not a rank: mpitrainrun, a login node's tools
    timeout = _start_timeout_from_environment()
    if timeout <= 0:
        return
    rank = next(os.environ[v] for v in _LAUNCHER_RANK_VARIABLES if v in os.environ)
    # The others a moment after rank 0, so that one rank usually speaks before the launcher
    # ends them all (when rank 0 is the late one, each waiting rank says it).
    stagger = 0.0 if rank == "0" else 3.0
    deadline = time.monotonic() - process_age() + timeout + VERDICT_GRACE_S + stagger
    message = (
        f"mpitrain: rank {rank} waited in MPI_Init past the start timeout of {timeout:g} s "
        "(MPITRAIN_START_TIMEOUT, mpitrainrun --start-timeout) for ranks that have not started "
        "MPI.  A rank is stuck or slow before mpitrain.init() (data loading, a lock, another "
        "host's file system), or was not started; MPI cannot say which before it starts.  "
        "Ending this rank so that the launcher ends the job: raise the timeout if that start "
        "is expected to take longer.\n").encode()
    parent = os.getpid()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the watchdog: nothing but os-level calls, then _exit
        try:
            os.close(write_end)
            _watch(read_end, deadline, parent, message)
        finally:
            os._exit(0)
    os.close(read_end)
    _watchdog.extend((child, write_end))
    sys.meta_path.insert(0, _MpiStartFinder())


def _watch(pipe: int, deadline: float, parent: int, message: bytes) -> None:
    """The watchdog's loop: a byte on ``pipe`` says MPI_Init began, end of file that it is
    done (or that the parent ended)."""
    begun = False
    while True:
        wait = deadline - time.monotonic() if begun else None
        if wait is not None and wait <= 0:
            if os.getppid() == parent:
                os.write(2, message)
                os.kill(parent, signal.SIGTERM)
            return
        ready, _, _ = select.select([pipe], [], [], wait)
        if ready:
            if not os.read(pipe, 1):
                return
            begun = True


class _MpiStartFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: tells the watchdog when ``mpi4py.MPI`` (MPI_Init) begins and ends."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "mpi4py.MPI":
            return None
        sys.meta_path.remove(self)  # one shot; the finders below do the finding
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            mpi_started()
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            if _watchdog:
                os.write(_watchdog[1], b"B")
            try:
                original(module)
            finally:
                mpi_started()

        loader.exec_module = exec_module
        return spec


def _start_timeout_from_environment() -> float:
    """The start timeout as set for this process; the configuration warns of a bad value."""
    for name in ("MPITRAIN_START_TIMEOUT", "HOROVOD_START_TIMEOUT"):
        text = os.environ.get(name, "").strip()
        if text:
            try:
                return max(0.0, float(text))
            except ValueError:
                return 0.0
    return 0.0


def mpi_started() -> None:
    """MPI_Init has returned in this process (or will not be watched): the watchdog ends."""
    if _watchdog:
        child, write_end = _watchdog
        _watchdog.clear()
        os.close(write_end)
        os.waitpid(child, 0)  # it reads the end of the pipe and exits at once


def process_age() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere: since mpitrain's
    import, the closest this module can see)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


class _Roll:
    """Who has reached the gate, for the start timeout: every rank tells rank 0, rank 0 tells
    every rank; all of it posted before the barrier, so that it all completes with it."""

    def __init__(self, MPI: Any, world: Any, timeout: float) -> None:
        self.MPI, self.world, self.timeout = MPI, world, timeout
        self.rank, self.size = world.Get_rank(), world.Get_size()
        now = time.monotonic()
        self.deadline = max(now - process_age() + timeout, now + LATE_ARRIVAL_S)
        peers = range(1, self.size) if self.rank == 0 else [0]
        # Empty messages; the buffers are kept while MPI may hold them.
        self.buffers = [bytearray(0) for _ in range(len(peers) + 1)]
        # rank 0: arrived[r] completes when rank r is here; elsewhere arrived[0] for rank 0.
        self.arrived = {r: world.Irecv([buf, MPI.BYTE], source=r, tag=TAG_ARRIVED)
                        for r, buf in zip(peers, self.buffers[1:])}
        self.sent = [world.Isend([self.buffers[0], MPI.BYTE], dest=r, tag=TAG_ARRIVED)
                     for r in peers]
        self.here: set[int] = {self.rank}
        self.verdict_sends: list[Any] = []

    def _update(self) -> None:
        for r, req in self.arrived.items():
            if r not in self.here and req.Test():
                self.here.add(r)

    def check(self) -> str | None:
        """The error to raise now (the start timeout has passed without everyone), or None."""
        self._update()
        if self.rank != 0:
            status = self.MPI.Status()
            if self.world.Iprobe(0, TAG_VERDICT, status):
                data = bytearray(status.Get_count(self.MPI.BYTE))
                self.world.Recv([data, self.MPI.BYTE], source=0, tag=TAG_VERDICT)
                return data.decode(errors="replace")
        now = time.monotonic()
        if now < self.deadline:
            return None
        if self.rank == 0:
            missing = [r for r in range(self.size) if r not in self.here]
            if not missing:
                return None  # everyone is here: the barrier completes in a moment
            text = self._named(missing)
            note = bytearray(text.encode())
            self.buffers.append(note)
            # Every rank that came raises the same words; the job ends with the first abort.
            self.verdict_sends = [self.world.Isend([note, self.MPI.BYTE], dest=r,
                                                   tag=TAG_VERDICT)
                                  for r in sorted(self.here - {0})]
            end = time.monotonic() + 1.0
            while not self.MPI.Request.Testall(self.verdict_sends) and time.monotonic() < end:
                time.sleep(1e-3)
            return text
        if 0 in self.here and now < self.deadline + VERDICT_GRACE_S:
            return None  # rank 0 is here and will name the missing ranks
        return self._unnamed()

    def _named(self, missing: list[int]) -> str:
        came = sorted(self.here)
        return (f"{ranks_text(missing)} of {self.size} did not reach mpitrain.init() within the "
                f"start timeout of {self.timeout:g} s (MPITRAIN_START_TIMEOUT, mpitrainrun "
                f"--start-timeout) while {ranks_text(came)} waited there; a rank stuck or "
                "slow before init() (data loading, a lock, another host's file system), or "
                "not started: raise the timeout if that start is expected to take longer")

    def _unnamed(self) -> str:
        who = ("rank 0 has not reached it either, and only rank 0 learns which ranks are "
               "missing" if 0 not in self.here else
               "rank 0 is there but its list of missing ranks did not come")
        return (f"some ranks of {self.size} did not reach mpitrain.init() within the start "
                f"timeout of {self.timeout:g} s (MPITRAIN_START_TIMEOUT, mpitrainrun "
                f"--start-timeout) while rank {self.rank} waited there; {who}")

    def finish(self) -> None:
        """The barrier completed: every rank posted its messages before entering it, so they
        all complete now."""
        self.MPI.Request.Waitall(list(self.arrived.values()) + self.sent)


def announce(MPI: Any, how: str = "") -> None:
    """Tell every other rank of MPI_COMM_WORLD that this one has ended before ``init()``
    (``how``, if known: "sys.exit(3)", "raised KeyError").

    Not collective; returns after the messages went out, or after :data:`SEND_SECONDS` (a
    peer that has not started MPI yet receives them once it does: MPI_Finalize keeps them
    moving).
    """
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        return
    note = bytearray(json.dumps({"rank": rank, "size": size, "host": socket.gethostname(),
                                 "pid": os.getpid(), "how": how}).encode())
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
        pass  # not JSON: treated as below
    # Not ours after all (a program of its own used our tag): still a rank that is not here.
    return {"rank": source}


def _left_message(note: dict[str, Any], me: int) -> str:
    where = ", ".join(f"{k} {note[k]}" for k in ("host", "pid") if k in note)
    size = f" of {note['size']}" if "size" in note else ""
    how = str(note.get("how") or "sys.exit(), the end of its script, or an uncaught error with "
                                  "MPITRAIN_ABORT_ON_ERROR=0")
    return (f"rank {note.get('rank', '?')}{size}{f' ({where})' if where else ''} ended before "
            f"calling mpitrain.init() ({how}), while rank {me} waited for it in init(); "
            "every rank must call init()")


__all__ = ["TAG", "TAG_ARRIVED", "TAG_VERDICT", "Phase", "announce", "enter", "gate", "phase",
           "process_age", "when_running"]
