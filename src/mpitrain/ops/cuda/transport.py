"""How device buffers travel: CUDA-aware MPI if the library has it, else pinned host staging.

Detection runs once at init() (``MPITRAIN_CUDA_AWARE_MPI=auto``, the default):

1. ``MPIX_Query_cuda_support()`` (Open MPI) or ``MPIX_GPU_query_support(CUDA)`` (MPICH),
   looked up in the libmpi this process has loaded: the library's own answer at run time;
2. else, for Open MPI, ``ompi_info --parsable --all``: ``mpi_built_with_cuda_support``
   (or ``opal_built_with_cuda_support``);
3. else no: staging is always correct, CUDA-aware is only faster.

``MPITRAIN_CUDA_AWARE_MPI=1``/``0`` overrides (some libraries need an environment variable
such as ``MPIR_CVAR_ENABLE_GPU=1`` that no query reflects).

Host staging cuts a bucket into chunks and pipelines them: chunk i+1 is copied down while chunk
i is reduced on the host by the CPU data plane and chunk i-1 is copied up, each copy on the
channel's stream into pinned memory (the only memory a copy overlaps with).  The order of the
pipeline is :func:`staging_schedule`, a pure function the tests check.
"""

from __future__ import annotations

import ctypes
import enum
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .streams import StreamBackend

STAGING_CHUNK_BYTES = 4 << 20  # large enough to hide MPI's per-call cost, small to pipeline


class Transport(str, enum.Enum):
    CUDA_AWARE_MPI = "cuda-aware-mpi"
    HOST_STAGING = "host-staging"
    CUDA_IPC = "cuda-ipc"
    LOCAL = "local"  # a world of one: nothing travels, the scales are applied where it lies


@dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI may be handed device pointers, and how that was decided."""

    supported: bool
    how: str


def loaded_libraries(pattern: str = "libmpi", maps: str = "/proc/self/maps") -> list[str]:
    """Paths of shared objects matching ``pattern`` that this process has mapped."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if pattern in line and "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def query_library(paths: Iterable[str],
                  load: Callable[[str], object] = ctypes.CDLL) -> CudaAwareness | None:
    """Ask the loaded MPI library itself; None when no library answers."""
    for path in paths:
        try:
            lib = load(path)
        except OSError:
            continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            return CudaAwareness(bool(query()), f"MPIX_Query_cuda_support() in {path}")
        gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
        if gpu_query is not None:
            flag = ctypes.c_int(0)
            mpix_gpu_support_cuda = 1  # MPICH's MPIX_GPU_SUPPORT_CUDA
            gpu_query(mpix_gpu_support_cuda, ctypes.byref(flag))
            return CudaAwareness(bool(flag.value), f"MPIX_GPU_query_support(CUDA) in {path}")
    return None


def parse_ompi_info(text: str) -> bool | None:
    """``mpi_built_with_cuda_support`` from ``ompi_info --parsable --all``; None if absent."""
    for key in ("mpi_built_with_cuda_support", "opal_built_with_cuda_support"):
        for line in text.splitlines():
            if f":{key}:value:" in line:
                return line.rsplit(":", 1)[-1].strip().lower() in ("true", "1", "yes")
    return None


def _run_ompi_info() -> str:
    try:
        return subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                              text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def detect(setting: str, library_version: str,
           libraries: Callable[[], list[str]] = loaded_libraries,
           load: Callable[[str], object] = ctypes.CDLL,
           ompi_info: Callable[[], str] = _run_ompi_info) -> CudaAwareness:
    """Decide whether MPI takes device buffers.

    Args:
        setting: ``auto``, or a forced ``1``/``0`` (MPITRAIN_CUDA_AWARE_MPI).
        library_version: ``MPI.Get_library_version()``.

    Raises:
        ValueError: ``setting`` is none of auto/1/0.
    """
    value = setting.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return CudaAwareness(True, "MPITRAIN_CUDA_AWARE_MPI=1")
    if value in ("0", "false", "no", "off"):
        return CudaAwareness(False, "MPITRAIN_CUDA_AWARE_MPI=0")
    if value != "auto":
        raise ValueError(f"MPITRAIN_CUDA_AWARE_MPI must be auto, 1 or 0, got {setting!r}")
    answer = query_library(libraries(), load)
    if answer is not None:
        return answer
    if "Open MPI" in library_version:
        built = parse_ompi_info(ompi_info())
        if built is not None:
            return CudaAwareness(built, "ompi_info: mpi_built_with_cuda_support")
    return CudaAwareness(False, "no CUDA support reported by the MPI library")


def choose(cuda_aware: bool, ranks_on_node: int, num_nodes: int, ipc_usable: bool,
           algorithm: str = "auto") -> list[tuple[str, Transport]]:
    """The phases of a device allreduce and the transport of each, in order.

    A world of one: no transport (the allreduce is its scaling; staging it through the host
    cost a round trip over PCIe per bucket).  One node with CUDA IPC: the device shared-memory
    algorithm alone.  Several nodes with IPC
    and ranks sharing nodes (hierarchical): reduce-scatter within the node over IPC, allreduce
    of each rank's slice across nodes, allgather within the node over IPC.  Otherwise one
    allreduce across everyone over MPI, handed device pointers or staged through the host.

    Raises:
        ValueError: an unknown ``algorithm``.
    """
    if algorithm not in ("auto", "shm", "ring", "hierarchical", "mpi"):
        raise ValueError(f"unknown allreduce algorithm {algorithm!r}")
    if ranks_on_node == 1 and num_nodes == 1:
        return [("allreduce", Transport.LOCAL)]
    across = Transport.CUDA_AWARE_MPI if cuda_aware else Transport.HOST_STAGING
    if algorithm in ("ring", "mpi") or not ipc_usable or ranks_on_node < 2:
        return [("allreduce", across)]
    if num_nodes == 1:
        return [("allreduce", Transport.CUDA_IPC)]
    if algorithm in ("auto", "hierarchical"):
        return [("reducescatter-local", Transport.CUDA_IPC), ("allreduce-cross", across),
                ("allgather-local", Transport.CUDA_IPC)]
    return [("allreduce", across)]


def staging_schedule(count: int, chunk: int) -> list[tuple[str, int]]:
    """The host-staging pipeline as (step, chunk index) in issue order.

    ``down i``: device to pinned host copy enqueued; ``reduce i``: the host waits for it and
    reduces on the CPU; ``up i``: host to device copy enqueued.  Chunk i+1 goes down before
    chunk i is reduced, so the copy overlaps the reduction; chunk i goes up right after its
    reduction, overlapping the next one.  Two host buffers alternate (i % 2).

    Raises:
        ValueError: a non-positive ``chunk`` or negative ``count``.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    n = (count + chunk - 1) // chunk
    steps: list[tuple[str, int]] = []
    if n:
        steps.append(("down", 0))
    for i in range(n):
        if i + 1 < n:
            # Buffer (i+1) % 2 was last used by chunk i-1, whose upload is already enqueued on
            # the same stream before this download, so stream order protects it.
            steps.append(("down", i + 1))
        steps.append(("reduce", i))
        steps.append(("up", i))
    return steps


Copy = Callable[[Any, Any, Any], None]  # copy(stream, destination, source), asynchronous


@dataclass(frozen=True)
class Staging:
    """The host side of a staged allreduce.

    Attributes:
        hosts: two pinned host buffers of at least ``chunk`` elements each.
        chunk: the elements one step moves.
        copy: enqueues an asynchronous copy on the channel's stream.
        reduce_host: allreduces a host chunk in place (the CPU data plane; collective, so
            every rank calls it for the same chunks in the same order).
    """

    hosts: Sequence[Any]
    chunk: int
    copy: Copy
    reduce_host: Callable[[Any], None]


def staged_allreduce(backend: StreamBackend, stream: Any, device: Any, count: int,
                     staging: Staging) -> None:
    """Allreduce ``device[:count]`` through two pinned host buffers, pipelined.

    Args:
        stream: the channel's stream; the copies run on it, in :func:`staging_schedule` order.
        device: the flat device buffer (sliceable); reduced in place.

    On return the uploads are enqueued on ``stream``, not finished: the caller orders later
    work after them with an event, as the channels do.
    """
    hosts, chunk, copy = staging.hosts, staging.chunk, staging.copy
    if len(hosts) != 2:
        raise ValueError(f"staging needs two host buffers, got {len(hosts)}")
    downloaded: dict[int, Any] = {}
    for step, i in staging_schedule(count, chunk):
        lo, hi = i * chunk, min(count, (i + 1) * chunk)
        host = hosts[i % 2][:hi - lo]
        if step == "down":
            copy(stream, host, device[lo:hi])
            downloaded[i] = backend.record(stream)
        elif step == "reduce":
            backend.host_wait(downloaded.pop(i))
            staging.reduce_host(host)
        else:
            copy(stream, device[lo:hi], host)
