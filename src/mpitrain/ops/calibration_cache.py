"""auto's choices kept across runs, so that a job started again begins at steady state.

:mod:`.calibration` times the contenders on a job's first allreduces of each size class.  Its
decisions hold as long as what decided them holds: the node layout, the MPI library, mpitrain's
own algorithms and the link.  Layout, library and version are known (the signature); the link
is measured -- a short probe (MPI's own Allreduce of :data:`PROBE_BYTES`, a few times, the
slowest rank's fastest) stored beside the choices.  A job finds the choices of an earlier run
with the same signature and a probe that says the same link (:func:`same_link`), and runs no
trials for those sizes; a faster link, another cluster, a new mpitrain or MPI library
calibrates afresh (and replaces that entry).  Each choice is stored with the time it took when
decided, and :class:`.calibration.Calibration` checks it on the job's first calls of its size:
a probe of 2 MiB can miss a change that decides at 32 MiB (on 2 cores it told unshaped veth
from a 1 Gbit/s link by less than 2x), so a choice that now takes another time is decided
again.  That check, not the probe, is what catches a slower link: load only ever adds to a
probe's time, and on 2 x 2 namespace hosts at 1 Gbit/s with other work on the 2 cores the
fastest of five 2 MiB calls, 17.4 ms in most jobs, came out at 88 and 187 ms in two jobs of one
run (2026-11-29); each time the entry was replaced and every choice it held was tried again,
mid-training.  So a probe up to :data:`SLOWER_TOLERANCE` times the stored one is the same
link, one more than :data:`LINK_TOLERANCE` times faster is not, and the stored probe is the
fastest seen.  The contenders that lost plainly are stored too: a size class first met by a
later job leaves them out of its trials as it would in the job that decided its neighbours.

Rank 0 alone reads and writes the file (``MPITRAIN_CALIBRATION_CACHE``; a JSON object, one
entry per signature); what it read travels to the other ranks by broadcast, so every rank
starts from the same choices.  Writes replace the file atomically; the file is private to the
user (0600, in a 0700 directory).  An unreadable or malformed file is ignored (and rewritten).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..core.version import __version__
from .calibration import Key, Settled
from .group import Group

PROBE_BYTES = 2 << 20
# The fastest of these calls is the link's time: load only ever adds to it.  The median of
# three, taken right after init() on 2 shared cores, once came out 2x off the first job's in
# the next job on the same cluster (2 x 2 namespace hosts, 1 Gbit/s, 2026-11-29): the entry
# was replaced, and every choice it held was tried again, mid-training.
PROBE_CALLS = 5
# A probe this many times faster than the stored one is another link; one up to
# SLOWER_TOLERANCE times slower is the same link under load (see the module docstring).
LINK_TOLERANCE = 2.0
SLOWER_TOLERANCE = 16.0


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


def link_probe(group: Group, clock: Callable[[], float] = time.perf_counter) -> float:
    """The probe's time in microseconds, the same on every rank (collective over the group)."""
    buf = np.zeros(PROBE_BYTES // 4, dtype=np.float32)
    out = np.empty_like(buf)
    group.comm.Allreduce(buf, out)  # connections up before anything is timed
    times = []
    for _ in range(PROBE_CALLS):
        start = clock()
        group.comm.Allreduce(buf, out)
        times.append(group.comm.allreduce(clock() - start, op=MPI.MAX))
    return max(min(times), 1e-6) * 1e6


def same_link(stored_us: float, probed_us: float) -> bool:
    """Whether ``probed_us`` measured the link that ``stored_us`` did: not more than
    :data:`LINK_TOLERANCE` times faster, nor more than :data:`SLOWER_TOLERANCE` times slower."""
    return (stored_us > 0 and probed_us > 0
            and stored_us / LINK_TOLERANCE <= probed_us <= stored_us * SLOWER_TOLERANCE)


def signature(group: Group) -> str:
    """What the choices depend on besides the link, as one string (the same on every rank)."""
    local_sizes = group.comm.allgather(group.topology.local_size)
    library = MPI.Get_library_version().splitlines()[0].strip()
    return json.dumps({"mpitrain": __version__, "mpi": library, "ranks": group.size,
                       "nodes": group.topology.num_nodes, "local_sizes": local_sizes},
                      sort_keys=True)


def load(group: Group, sig: str, link_us: float) -> dict[Key, Settled]:
    """The decisions stored for ``sig`` on this link, with the time each took and the
    contenders that lost plainly where the entry has them (read on rank 0, broadcast);
    collective."""
    found: dict[str, tuple[str, float | None, list[str]]] = {}
    path = cache_path(group)
    if group.rank == 0 and path is not None:
        entry = _read(path).get(sig)
        choices = _entry_choices(entry, link_us)
        times = _entry_map(entry, "seconds") if choices else {}
        losers = _entry_map(entry, "losers") if choices else {}
        for text, choice in choices.items():
            if not (isinstance(choice, str) and _valid(text)):
                continue
            seconds = times.get(text)
            lost = losers.get(text)
            found[text] = (choice,
                           float(seconds) if isinstance(seconds, (int, float))
                           and seconds > 0 else None,
                           [n for n in lost if isinstance(n, str)]
                           if isinstance(lost, list) else [])
    found = group.comm.bcast(found, root=0)
    return {_key(text): Settled(choice, seconds, frozenset(lost))
            for text, (choice, seconds, lost) in found.items()}


def stored_link(group: Group, sig: str) -> float | None:
    """The probe time (microseconds) the entry for ``sig`` was measured with, if the file has
    one; read on rank 0 only (for its log), not collective."""
    path = cache_path(group)
    entry = _read(path).get(sig) if path is not None else None
    link = entry.get("link_us") if isinstance(entry, dict) else None
    return float(link) if isinstance(link, (int, float)) else None


def store(group: Group, sig: str, link_us: float, key: Key, settled: Settled) -> None:
    """Record one decision (rank 0 writes; other ranks do nothing).  An entry measured on
    another link is replaced, not merged."""
    path = cache_path(group)
    if group.rank != 0 or path is None:
        return
    data = _read(path)
    entry = data.get(sig)
    kept = _entry_choices(entry, link_us)
    # The fastest probe of this link is its reference (kept is non-empty only for a
    # well-formed entry).
    link = min(entry["link_us"], link_us) if kept and isinstance(entry, dict) else link_us
    times = _entry_map(entry, "seconds") if kept else {}
    losers = _entry_map(entry, "losers") if kept else {}
    text = _text(key)
    times.pop(text, None)
    if settled.seconds is not None:
        times[text] = settled.seconds
    losers[text] = sorted(settled.losers)
    data[sig] = {"link_us": link, "choices": {**kept, text: settled.choice}, "seconds": times,
                 "losers": losers}
    with contextlib.suppress(OSError):  # a read-only home must not fail a training step
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".allreduce-choices-", dir=path.parent)
        with os.fdopen(fd, "w") as f:  # mkstemp creates it 0600
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)


def _entry_map(entry: object, name: str) -> dict[str, object]:
    """A copy of an entry's ``name`` map (per size class), or an empty one."""
    value = entry.get(name) if isinstance(entry, dict) else None
    return dict(value) if isinstance(value, dict) else {}


def _entry_choices(entry: object, link_us: float) -> dict[str, str]:
    """An entry's choices if it is well formed and was measured on this link, else none."""
    if not isinstance(entry, dict):
        return {}
    stored, choices = entry.get("link_us"), entry.get("choices")
    if not isinstance(stored, (int, float)) or not isinstance(choices, dict):
        return {}
    return dict(choices) if same_link(float(stored), link_us) else {}


def _read(path: Path) -> dict[str, object]:
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
