"""A Chrome-trace (JSON) timeline of what the engine did with every tensor.

One row per tensor name.  Each request shows NEGOTIATE_<OP> (submitted until every rank had
it), QUEUE (decided until its bucket started), MEMCPY_IN_FUSION_BUFFER, the collective itself
and MEMCPY_OUT_FUSION_BUFFER.  Written by rank 0 only, as Horovod does; the file is a valid JSON
array once the timeline is stopped (at shutdown at the latest) and opens in Perfetto and
chrome://tracing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

from ..core import private


class Timeline:
    def __init__(self, enabled_here: bool) -> None:
        self._enabled_here = enabled_here
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._rows: dict[str, int] = {}
        self._first = True
        self._origin = time.monotonic()
        self.mark_cycles = False

    @property
    def active(self) -> bool:
        return self._file is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Begin writing to ``path`` (rank 0 only; elsewhere a no-op). Replaces a running one."""
        if not self._enabled_here:
            return
        if not path:
            raise ValueError("start_timeline needs a file path, got an empty string")
        self.stop()
        private.make_dirs(os.path.dirname(os.path.abspath(path)))
        with self._lock:
            # Every tensor's name and timing: the user's alone (0600).  Closed in stop().
            self._file = private.open_file(path, "w", encoding="utf-8")
            self._file.write("[\n")
            self._first = True
            self._rows = {}
            self.mark_cycles = mark_cycles
            self._write({"name": "process_name", "ph": "M", "pid": 0,
                         "args": {"name": "mpitrain rank 0"}})

    def stop(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    def _write(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        if not self._first:
            self._file.write(",\n")
        self._first = False
        self._file.write(json.dumps(event, separators=(",", ":")))

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = len(self._rows) + 1
            self._rows[name] = row
            self._write({"name": "thread_name", "ph": "M", "pid": 0, "tid": row,
                         "args": {"name": name}})
        return row

    def _us(self, t: float) -> float:
        return round((t - self._origin) * 1e6, 3)

    def span(self, tensor: str, phase: str, start: float, end: float,
             args: dict[str, Any] | None = None) -> None:
        """Record ``phase`` of ``tensor`` from ``start`` to ``end`` (time.monotonic seconds)."""
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            event: dict[str, Any] = {"name": phase, "ph": "X", "pid": 0,
                                     "tid": self._row(tensor), "ts": self._us(start),
                                     "dur": round(max(0.0, end - start) * 1e6, 3)}
            if args:
                event["args"] = args
            self._write(event)

    def cycle(self, when: float) -> None:
        """Mark the start of a negotiation cycle (MPITRAIN_TIMELINE_MARK_CYCLES)."""
        if self._file is None or not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._write({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                             "ts": self._us(when)})
