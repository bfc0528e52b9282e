"""How ``mpitrainrun``'s elastic driver and a running job talk: two small files in a directory.

The driver (``mpitrainrun --host-discovery-script``) runs the discovery script while the job
trains.  It cannot reach into the job's processes, and the job's ranks cannot reach the driver
through MPI, so they share a *control directory* (``MPITRAIN_ELASTIC_CONTROL_DIR``; on the
driver's machine, which must also be rank 0's, or on a shared filesystem):

* ``hosts.json`` -- written by the driver, read by the job's rank 0 at every ``commit()``: a
  notice ``{"time": t, "update": flags}`` that hosts were added (flag 2) or removed (flag 1).
  Rank 0 broadcasts what it read, so every rank raises ``HostsUpdatedInterrupt`` at the same
  commit.
* ``events.jsonl`` -- appended by the job's rank 0, read by the driver: ``roster`` (which host
  each world rank runs on), ``lost`` (world ranks and hosts the survivors lost, after an
  in-place recovery) and ``stopping`` (the job stops at a commit so that the driver restarts it
  on the new hosts).

Both sides only ever replace ``hosts.json`` whole (a rename) and append whole lines to
``events.jsonl``, so a reader never sees half a record.  The directory is 0700 and the files
0600 (:mod:`mpitrain.core.private`).  Ground floor: no MPI, no framework.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from . import private

NOTICE = "hosts.json"
EVENTS = "events.jsonl"

ADDED = 2  # the flags of HostUpdateResult (mpitrain.elastic.state)
REMOVED = 1


def write_notice(directory: str, time: float, update: int) -> None:
    """Driver side: tell the job (at its next commit) that hosts changed, as of ``time``."""
    target = os.path.join(directory, NOTICE)
    tmp = f"{target}.tmp-{os.getpid()}"
    with private.open_file(tmp, "w") as f:
        json.dump({"time": time, "update": int(update)}, f)
    os.replace(tmp, target)


def read_notice(directory: str) -> tuple[float, int] | None:
    """Job side (rank 0): the driver's latest notice as ``(time, flags)``, or None."""
    try:
        with open(os.path.join(directory, NOTICE)) as f:
            notice = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None  # none yet (a rename makes a half-written file impossible; be lenient)
    return float(notice["time"]), int(notice["update"])


def append_event(directory: str, event: str, **fields: Any) -> None:
    """Job side (rank 0): record one event as a JSON line (one write, so it lands whole)."""
    line = json.dumps({"event": event, **fields}) + "\n"
    with private.open_file(os.path.join(directory, EVENTS), "ab", buffering=0) as f:
        f.write(line.encode())  # one write of a whole line: a reader never sees half of it


def read_events(directory: str) -> list[dict[str, Any]]:
    """Driver side: every complete event the job has recorded so far, oldest first."""
    try:
        with open(os.path.join(directory, EVENTS)) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines(keepends=True):
        if line.endswith("\n"):  # a line still being written is read next time
            events.append(json.loads(line))
    return events


def reset(directory: str) -> None:
    """Driver side, before each launch: an empty control directory for the new job, 0700
    (it says which hosts run the job), its files 0600."""
    private.make_dirs(directory)
    os.chmod(directory, private.DIR_MODE)  # ours even if an earlier run left it
    for name in (NOTICE, EVENTS):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


__all__ = ["ADDED", "REMOVED", "append_event", "read_events", "read_notice", "reset",
           "write_notice"]
