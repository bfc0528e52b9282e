"""``env://`` rendezvous under mpirun: rank and world size from MPI, no MASTER_ADDR needed.

``init_process_group(backend=...)`` without a store or URL uses torch's ``env://`` rendezvous,
which wants RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment: torchrun sets
them, mpirun does not.  :func:`install` wraps torch's handler so that, *only when some of those
variables are missing and the process was started by an MPI launcher* (or mpitrain is already
initialised), the missing pieces come from MPI instead: rank and size are mpitrain's (which
initialises mpitrain, collectively), and the store is the job's own (:mod:`.store`): served by
rank 0 on the loopback address and, for ranks on other hosts, on the address facing them
(never a wildcard), on a free port, and usable only by processes that prove they hold the
random key rank 0 sends the ranks over MPI.  A real network store, not a local HashStore, so
that Gloo groups created beside mpitrain's work too.  MASTER_ADDR/MASTER_PORT, when the user
sets both, still win: then torch's own TCPStore is used there, as they asked.

In every other case torch's own handler runs unchanged, with its own errors.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ... import collectives, session
from ...core import runtime, topology
from .store import JobStore, StoreServer, close_clients, new_key

# MASTER_ADDR as this module set it (name -> value), for forget_store().
_advertised: dict[str, str] = {}
_served: list[StoreServer] = []  # rank 0's server, until forget_store()

_LAUNCHER_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
                            "PALS_RANKID")


def under_mpi_launcher() -> bool:
    """True when an MPI launcher started this process, or mpitrain is already running."""
    if runtime.is_initialized():
        return True
    return (topology.env_local_rank() is not None
            or any(v in os.environ for v in _LAUNCHER_RANK_VARIABLES))


def _query(url: str) -> dict[str, str]:
    return {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}


def _env_complete(url: str) -> bool:
    query = _query(url)
    have_rank = "rank" in query or bool(os.environ.get("RANK"))
    have_size = "world_size" in query or bool(os.environ.get("WORLD_SIZE"))
    return (have_rank and have_size and bool(os.environ.get("MASTER_ADDR"))
            and bool(os.environ.get("MASTER_PORT")))


def _check_agrees(what: str, given: str | None, mpi_value: int) -> None:
    if given not in (None, "") and int(given) != mpi_value:
        raise ValueError(f"init_process_group: {what}={given} disagrees with MPI, which says "
                         f"{mpi_value}; under mpirun leave it unset or pass MPI's value")


def _store(rank: int, size: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's store (see the module); torch's TCPStore at MASTER_ADDR:MASTER_PORT if the
    user gave both.  Collective over the job (rank 0 broadcasts where it listens, and the key).
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return dist.TCPStore(addr, int(port), size, rank == 0, timeout=timeout)
    hosts = collectives.allgather_object(socket.gethostname(), name="c10d.rendezvous.hosts")
    offer = None
    if rank == 0:
        facing = _addresses_facing(hosts)
        server = StoreServer(new_key(), ["127.0.0.1", *sorted(set(facing.values()))])
        _served.append(server)
        offer = (server.port, server.key, facing)
    free_port, key, facing = collectives.broadcast_object(offer, root_rank=0,
                                                          name="c10d.rendezvous.store")
    here = socket.gethostname()
    connect = "127.0.0.1" if here == hosts[0] else facing[here]
    # Where rank 0 is, for libraries that read it (Accelerate insists on MASTER_ADDR when a
    # job spans several hosts).  Not MASTER_PORT: torch's TCPStore client, which a later
    # env:// rendezvous would start there, cannot prove the key and would be refused.
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _advertised["MASTER_ADDR"] = connect
    return JobStore(connect, free_port, key, timeout)


def _addresses_facing(hosts: list[str]) -> dict[str, str]:
    """For every host of the job other than this one (rank 0's), the address of this host that
    the kernel routes traffic to it from: where that host's ranks reach the store.

    Raises:
        ValueError: a host's name does not resolve here.
    """
    facing: dict[str, str] = {}
    for host in dict.fromkeys(hosts[1:]):
        if host == hosts[0]:
            continue
        try:
            remote = socket.gethostbyname(host)
        except OSError as exc:
            raise ValueError(f"init_process_group: host {host!r} of this job does not resolve "
                             f"on rank 0's host ({exc}); the job's store must know where that "
                             "host's ranks reach it. Fix the name (/etc/hosts, DNS) or set "
                             "MASTER_ADDR and MASTER_PORT") from None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((remote, 9))  # UDP: picks the route, sends nothing
            facing[host] = probe.getsockname()[0]
    return facing


def forget_store() -> None:
    """Close the store rank 0 served and unset the MASTER_ADDR :func:`_store` advertised
    (unless changed since), so that the next rendezvous serves a new store: after an elastic
    rebuild, the old rank 0 that served this one may be gone."""
    for name, value in list(_advertised.items()):
        if os.environ.get(name) == value:
            del os.environ[name]
        del _advertised[name]
    close_clients()
    while _served:
        _served.pop().close()


def mpi_rendezvous(url: str, timeout: datetime.timedelta) -> Iterator[tuple[Any, int, int]]:
    """Yield (store, rank, world_size) from MPI, once (torch's handler protocol)."""
    session.init()
    rank, size = runtime.rank(), runtime.size()
    query = _query(url)
    _check_agrees("rank", query.get("rank", os.environ.get("RANK")), rank)
    _check_agrees("world_size", query.get("world_size", os.environ.get("WORLD_SIZE")), size)
    yield _store(rank, size, timeout), rank, size
    raise RuntimeError("Unable to perform re-rendezvous using env:// under MPI")


def install() -> None:
    """Wrap torch's ``env://`` handler with the MPI fallback (idempotent, communicates nothing)."""
    # importlib, because torch.distributed.rendezvous is also the name of a function there.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    original: Callable[..., Iterator[Any]] | None = rdzv._rendezvous_handlers.get("env")
    if original is None or getattr(original, "_mpitrain_fallback", False):
        return

    def env_or_mpi(url: str, timeout: datetime.timedelta = dist.default_pg_timeout,
                   **kwargs: Any) -> Iterator[Any]:
        if _env_complete(url) or not under_mpi_launcher():
            return original(url, timeout=timeout, **kwargs)
        return mpi_rendezvous(url, timeout)

    env_or_mpi._mpitrain_fallback = True  # type: ignore[attr-defined]
    rdzv._rendezvous_handlers["env"] = env_or_mpi


__all__ = ["forget_store", "install", "mpi_rendezvous", "under_mpi_launcher"]
