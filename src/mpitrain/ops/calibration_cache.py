"""auto's choices kept across runs, so that a job started again begins at steady state.

:mod:`.calibration` times the contenders on a job's first allreduces of each size class.  Its
decisions hold as long as what decided them holds: the node layout, the MPI library, mpitrain's
own algorithms and the link.  Layout, library and version are known; the link is measured --
a short probe (MPI's own Allreduce of :data:`PROBE_BYTES`, a few times, the slowest rank's
median) put in a class of factors of two.  A job finds the choices of an earlier run with the
same signature and runs no trials for those sizes; a shaped-down link, another cluster, a new
mpitrain or MPI library is another signature, and calibrates afresh.

Rank 0 alone reads and writes the file (``MPITRAIN_CALIBRATION_CACHE``; a JSON object, one
entry per signature); what it read travels to the other ranks by broadcast, so every rank
starts from the same choices.  Writes replace the file atomically; the file is private to the
user (0600, in a 0700 directory).  An unreadable or malformed file is ignored (and rewritten).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..version import __version__
from .group import Group

PROBE_BYTES = 2 << 20
PROBE_CALLS = 3

Key = tuple[bool, int]  # a calibration size class: (16-bit element type, bits)


def cache_path(group: Group) -> Path | None:
    """The file, or None when the cache is off (an empty value or ``0``).  Only rank 0's
    setting counts (:func:`enabled` tells the others)."""
    value = group.config.calibration_cache.strip()
    if value in ("", "0"):
        return None
    return Path(value).expanduser()


def enabled(group: Group) -> bool:
    """Whether rank 0 keeps a cache: agreed by broadcast, since the probe is collective."""
    return bool(group.comm.bcast(cache_path(group) is not None if group.rank == 0 else None,
                                 root=0))


def link_class(group: Group, clock: Callable[[], float] = time.perf_counter) -> int:
    """The link as a class of factors of two of a probe's time (collective over the group)."""
    buf = np.zeros(PROBE_BYTES // 4, dtype=np.float32)
    out = np.empty_like(buf)
    group.comm.Allreduce(buf, out)  # connections up before anything is timed
    times = []
    for _ in range(PROBE_CALLS):
        start = clock()
        group.comm.Allreduce(buf, out)
        times.append(group.comm.allreduce(clock() - start, op=MPI.MAX))
    return int(round(math.log2(max(statistics.median(times), 1e-6) * 1e6)))


def signature(group: Group, link: int) -> str:
    """What the choices depend on, as one string (the same on every rank of the group)."""
    local_sizes = group.comm.allgather(group.topology.local_size)
    library = MPI.Get_library_version().splitlines()[0].strip()
    return json.dumps({"mpitrain": __version__, "mpi": library, "ranks": group.size,
                       "nodes": group.topology.num_nodes, "local_sizes": local_sizes,
                       "link_class": link}, sort_keys=True)


def load(group: Group, sig: str) -> dict[Key, str]:
    """The choices stored for ``sig`` (read on rank 0, broadcast); collective."""
    found: dict[str, str] = {}
    path = cache_path(group)
    if group.rank == 0 and path is not None:
        entry = _read(path).get(sig)
        if isinstance(entry, dict):
            found = {text: choice for text, choice in entry.items()
                     if isinstance(choice, str) and _valid(text)}
    found = group.comm.bcast(found, root=0)
    return {_key(text): choice for text, choice in found.items()}


def store(group: Group, sig: str, key: Key, choice: str) -> None:
    """Record one decision (rank 0 writes; other ranks do nothing)."""
    path = cache_path(group)
    if group.rank != 0 or path is None:
        return
    data = _read(path)
    entry = data.get(sig)
    data[sig] = {**(entry if isinstance(entry, dict) else {}), _text(key): choice}
    with contextlib.suppress(OSError):  # a read-only home must not fail a training step
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".allreduce-choices-", dir=path.parent)
        with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _read(path: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text(key: Key) -> str:
    narrow, bits = key
    return f"{'16bit' if narrow else 'wide'}:{bits}"


def _valid(text: str) -> bool:
    kind, _, bits = text.partition(":")
    return kind in ("16bit", "wide") and bits.isdigit()


def _key(text: str) -> Key:
    kind, bits = text.split(":")
    return kind == "16bit", int(bits)
