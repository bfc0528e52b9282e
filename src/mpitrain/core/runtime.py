"""The ground floor: configuration, topology, communicators and device binding, and the rank
queries every layer reads.

:func:`start` (called by :func:`mpitrain.session.init`, which then starts the engine on top)
reads the configuration once, duplicates the job's communicator, works out the node layout and
binds the device.  Nothing here knows the engine: tearing everything above the communicators
down and building it again (elastic training) leaves this floor standing.  No layer reads the
environment again after :func:`start`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

from . import (
    _mpi,
    binding,
    collector,
    departures,
    failure,
    host_malloc,
    job_env,
    launchers,
    survivors,
    topology,
)
from . import config as config_module
from .departures import Phase
from .errors import not_initialized
from .topology import Communicators, Topology


@dataclass
class State:
    """Everything start() established, torn down by stop()."""

    config: config_module.Config
    topology: Topology
    comms: Communicators
    thread_level: int
    device: int | None
    cpu_threads: int | None
    # A duplicate of the job's communicator that carries no traffic, so that it outlives the
    # engine (which frees what it talks on): elastic survivors agree on who is left over it.
    spare: Any = None


_state: State | None = None
_lock = threading.RLock()
_hook_installed = False


def _resolve_comm(MPI: Any, comm: Any) -> Any:
    """Turn init()'s ``comm`` argument into a private duplicate communicator."""
    if comm is None:
        return MPI.COMM_WORLD.Dup()
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("init(comm=MPI.COMM_NULL): this process is not part of that "
                             "communicator")
        return comm.Dup()
    if isinstance(comm, (list, tuple, range)):
        ranks = [int(r) for r in comm]
        world = MPI.COMM_WORLD
        bad = [r for r in ranks if not 0 <= r < world.Get_size()]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"init(comm={list(comm)!r}): ranks must be distinct and within "
                             f"0..{world.Get_size() - 1}")
        if world.Get_rank() not in ranks:
            raise ValueError(f"init(comm={ranks!r}): world rank {world.Get_rank()} is not in "
                             "that list; only the listed ranks may call init() with it")
        group = world.Get_group().Incl(ranks)
        sub = world.Create_group(group)
        group.Free()
        return sub
    raise TypeError(f"init(comm=...) takes an mpi4py communicator or a list of world ranks, "
                    f"not {type(comm).__name__}")


def start(comm: Any = None) -> State:
    """Establish the ground floor: communicators, topology, device binding (collective).

    Every rank of ``comm`` must call this, in the same order.  Called by
    :func:`mpitrain.session.init`; see there for ``comm``.

    Raises:
        ValueError: this process is not part of ``comm``, or the rank list is malformed.
        TypeError: ``comm`` is neither a communicator nor a list of ranks.
        RuntimeError: already started (session.init checks first).
        mpitrain.core.launchers.LauncherMismatchError: a launcher started several processes but MPI
            sees a world of one (torchrun, srun without PMI, another MPI's mpirun); see
            :mod:`mpitrain.core.launchers`.
    """
    global _state
    with _lock:
        if _state is not None:
            raise RuntimeError("mpitrain's runtime is already started")
        MPI = _mpi.load()
        departures.mpi_started()  # MPI is up: the start timeout's watchdog (if any) ends
        cfg = config_module.load()
        launchers.check_world(MPI.COMM_WORLD.Get_size(), cfg.allow_singleton,
                              _mpi.library_version())
        if comm is None:
            # Every rank of the world must come here; one that has ended never will, and
            # says so (see mpitrain.core.departures) instead of leaving this rank in MPI for ever.
            try:
                departures.gate(MPI, cfg.start_timeout)
            except BaseException:
                departures.enter(Phase.FAILED)
                raise
        job_comm = _resolve_comm(MPI, comm)  # its mistakes are raised before any collective
        departures.enter(Phase.STARTING)
        comms = None
        try:
            spans_world = job_comm.Get_size() == MPI.COMM_WORLD.Get_size()
            job_env.check_torch_world(job_comm.Get_size())
            topo, comms = topology.build(job_comm, emulated_local_size=cfg.local_size,
                                         use_launcher_env=spans_world)
            device = binding.bind_device(topo.local_rank) if cfg.bind_device else None
            job_env.export(topo.rank, topo.size, topo.local_rank, topo.local_size,
                           has_gpu=binding.cuda_device_count() > 0)
            threads = (binding.set_cpu_threads(topo.machine_local_size) if cfg.set_cpu_threads
                       else None)
            host_malloc.keep_freed_memory(cfg.malloc_trim_threshold)
            collector.freeze_imports(cfg.gc_freeze)
            failure.arm(comms.world, topo)  # collective: before any thread above uses MPI
            spare = comms.world.Dup()
        except BaseException:
            # Peers may be waiting for this rank in a collective of the ones being built:
            # where MPI can (ULFM), make those collectives fail rather than wait forever;
            # elsewhere this rank's exit aborts the job (mpitrain.core.failure).
            departures.enter(Phase.FAILED)
            survivors.revoke([job_comm] + ([comms.world, comms.local, comms.cross]
                                           if comms is not None else []))
            raise
        _state = State(config=cfg, topology=topo, comms=comms,
                       thread_level=MPI.Query_thread(), device=device, cpu_threads=threads,
                       spare=spare)
        if cfg.abort_on_error:
            _install_abort_hook()
    _check_settings_agree(cfg, comms.world)
    return _state


def _check_settings_agree(cfg: config_module.Config, comm: Any) -> None:
    """Raise the same ValueError on every rank if a :data:`config.MUST_AGREE` setting differs.

    Collective (one small allgather).  After the runtime is up, so that the abort hook prints
    the error once for all ranks rather than once per rank.
    """
    mine = [getattr(cfg, field) for field in config_module.MUST_AGREE]
    problems = config_module.disagreements(comm.allgather(mine))
    if problems:
        # Every rank raises this, after the same collective: nobody is left waiting.
        departures.enter(Phase.STOPPED)
        raise ValueError(
            "mpitrain settings differ between ranks, which would leave them waiting in "
            "different collectives: " + "; ".join(problems) + ". Give every rank the same "
            "value (Open MPI's mpirun forwards a variable to other hosts only with -x NAME, "
            "mpitrainrun forwards every MPITRAIN_*, HOROVOD_* and PERSEUS_* variable).")


def stop() -> None:
    """Free the communicators and withdraw the exported job variables (after the engine
    stopped).  Does nothing when not started."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is None:
        return
    try:
        failure.disarm()
    finally:
        if state.spare is not None:
            with contextlib.suppress(Exception):  # best effort at teardown
                state.spare.Free()
        state.comms.free()
        job_env.withdraw()


def take_spare() -> Any:
    """Hand the spare communicator to the caller, who frees it; stop() then leaves it alone.

    Elastic recovery shrinks it to the survivors after everything built on the job's
    communicator is gone (a Dup of it would fail: it contains the dead).
    """
    current = state()
    spare, current.spare = current.spare, None
    return spare


def is_initialized() -> bool:
    """Return True between init() and shutdown() (between start() and stop())."""
    return _state is not None


def state() -> State:
    """Return the running state or raise the not-initialised ValueError."""
    current = _state
    if current is None:
        raise not_initialized()
    return current


def _topology() -> Topology:
    """The running job's topology, which the rank queries below read (each raises the
    not-initialised ValueError before init(), as :func:`state` does)."""
    return state().topology


def rank() -> int:
    """Index of this process in the job, 0..size()-1.

    The job is the communicator init() was given (``MPI.COMM_WORLD`` by default); rank 0 is the
    one that conventionally logs, saves checkpoints and broadcasts the initial state.
    """
    return _topology().rank


def size() -> int:
    """Number of processes in the job: what an ``Average`` over all ranks divides by."""
    return _topology().size


def local_rank() -> int:
    """Index of this process among the processes of its node, 0..local_size()-1: the usual
    choice of GPU (``torch.cuda.set_device(hvd.local_rank())``).

    With ``MPITRAIN_LOCAL_SIZE=k`` the node is an emulated one of k consecutive local ranks.
    """
    return _topology().local_rank


def local_size() -> int:
    """Number of processes on this node; nodes may differ (see :func:`is_homogeneous`)."""
    return _topology().local_size


def cross_rank() -> int:
    """Index of this node among the nodes holding a process with this local rank.

    Nodes are numbered by their lowest rank; when every node runs the same number of processes,
    this is the node's index.
    """
    return _topology().cross_rank


def cross_size() -> int:
    """Number of nodes holding a process with this local rank: the number of nodes when every
    node runs the same number of processes."""
    return _topology().cross_size


def is_homogeneous() -> bool:
    """True when every node runs the same number of processes (then cross_size() is the number
    of nodes on every rank)."""
    return _topology().is_homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE."""
    MPI = _mpi.load()
    return state().thread_level >= MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True once init() has run: mpitrain always talks MPI at run time.

    As in Horovod, this is a question, not a rank query: before init() (and after shutdown())
    the answer is False, not an error.
    """
    return _state is not None


def gloo_enabled() -> bool:
    """False, before init() too: mpitrain has no Gloo controller (Gloo is only a peer in
    benchmarks)."""
    return False


# Build facts describe this installation, not a running job, so (as in Horovod) they answer
# before init() too.


def mpi_built() -> bool:
    """True: MPI support is always part of mpitrain."""
    return True


def gloo_built() -> bool:
    """False: mpitrain does not use Gloo; it always runs over MPI (``mpitrainrun --gloo`` is
    accepted for horovodrun scripts and runs over MPI too)."""
    return False


def nccl_built() -> bool:
    """False: mpitrain reduces on the GPU with its own kernels, not NCCL.

    Horovod's Adasum examples scale the learning rate by ``local_size()`` only when this is
    True; False picks the rule for mpitrain's default, flat Adasum (see :mod:`mpitrain.ops.adasum`).
    """
    return False


def ddl_built() -> bool:
    """False: mpitrain has no IBM DDL backend."""
    return False


def ccl_built() -> bool:
    """False: mpitrain does not use Intel oneCCL; its CPU reductions are its own kernels."""
    return False


def cuda_built() -> bool:
    """True when the CUDA data plane can run here (cupy importable and a GPU visible)."""
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken cupy both mean no CUDA path
        return False
    return binding.cuda_device_count() > 0


def rocm_built() -> bool:
    """False: no ROCm data plane (the GPU data plane is CUDA's, see :func:`cuda_built`)."""
    return False


def _install_abort_hook() -> None:
    """Make an uncaught exception on any rank end the whole job, naming the rank.

    Without this, the other ranks sit in their next collective forever.
    """
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = failure.hook_below_ours(sys.excepthook)

    def abort_on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
        current = _state
        if current is None:  # before, in or after a session: others may still wait for us
            failure.handle_outside_session(exc_type, exc, tb, previous)
            return
        if (current.topology.size == 1 or not current.config.abort_on_error
                or issubclass(exc_type, KeyboardInterrupt)):
            try:
                previous(exc_type, exc, tb)
            except Exception:  # noqa: BLE001 - never let printing stop the exit
                traceback.print_exception(exc_type, exc, tb)
            return
        # Prints once per distinct message across the ranks that fail together, then aborts.
        failure.report_and_abort(exc_type, exc, tb, previous)

    sys.excepthook = abort_on_uncaught
