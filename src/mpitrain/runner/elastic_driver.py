"""``mpitrainrun --host-discovery-script``: keep an elastic job on the hosts that are there.

The driver loop, in the launcher's process (one job at a time):

1. Run the discovery script; leave out blacklisted hosts; wait (up to ``--elastic-timeout``)
   until they offer ``--min-np`` slots; place ``-np`` ranks on them at the first start and
   ``--max-np`` at later ones (hosts keep their order, new ones come last).
2. Start the job there (``mpirun --with-ft ulfm`` with Open MPI, so that survivors of a lost
   rank continue in place; a plain launch otherwise).  While it runs, read the events its rank 0
   records (:mod:`mpitrain.core.elastic_control`) and run the discovery script every
   ``--discovery-interval`` seconds.  A host whose rank the job lost is blacklisted.  When the
   hosts would give the job more ranks than it has now, or a host it uses disappears from the
   list, tell the job; it stops at its next ``commit()`` after writing that commit to the state
   file.
3. When the job ends: after such a stop, start it again on the new hosts (not counted as a
   failure); after a failure, blacklist the failed ranks' hosts (from the job's roster and
   mpirun's own report) and start it again from the last commit, at most ``--reset-limit``
   times; after success, remove the state file (unless the user named it) and exit 0.

Why a restart and not spawning into the running job: see
:func:`mpitrain.elastic.driver.stop_for_new_hosts`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core import elastic_control
from .discovery import Blacklist, DiscoveryError, order_hosts, place
from .hosts import HostSlots
from .signals import forwarding_signals

# How launchers name a rank that failed.  Open MPI: "process rank 1 with PID 9 on node vm
# exited on signal 9" (a signal), or "Process name: [prterun-vm-9@1,1]" (an exit status; the
# rank is the last number).  MPICH/Hydra: "RANK 1 PID 9 RUNNING AT node".
_FAILED_RANK_PATTERNS = (
    re.compile(r"process\s+rank\s+(?P<rank>\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+"
               r"(?P<host>\S+)\s+exited"),
    re.compile(r"Process\s+name:\s*\[[^\]]*,(?P<rank>\d+)\]"),
    re.compile(r"RANK\s+(?P<rank>\d+)\s+PID\s+\d+\s+RUNNING\s+AT\s+(?P<host>\S+)"),
)


def failed_ranks(launcher_output: str) -> list[int]:
    """The world ranks the launcher's report names as failed, in the order reported."""
    ranks: list[int] = []
    for pattern in _FAILED_RANK_PATTERNS:
        for match in pattern.finditer(launcher_output):
            rank = int(match.group("rank"))
            if rank not in ranks:
                ranks.append(rank)
    return ranks


def host_of_rank(layout: Sequence[HostSlots], rank: int) -> str | None:
    """The host (as the discovery script names it) that world rank ``rank`` ran on: the job
    is launched with consecutive ranks per host, in layout order (``--map-by slot``)."""
    first = 0
    for h in layout:
        if rank < first + h.slots:
            return h.host
        first += h.slots
    return None


@dataclass
class DriverOptions:
    """What the command line asked of the driver."""

    np: int
    min_np: int
    max_np: int
    restarts: int
    elastic_timeout_s: float
    interval_s: float
    control_dir: str
    state_file: str
    keep_state_file: bool


@dataclass
class Outcome:
    """How one launch of the job ended."""

    code: int
    stopped_to_grow: bool
    lost_hosts: list[str]


class ElasticDriver:
    """Runs the driver loop (see the module).

    Args:
        options: the limits and files.
        discover: ``f() -> {host: slots}``, the discovery script (raises DiscoveryError).
        blacklist: hosts not to use, for now or for good.
        command_for: ``f(layout) -> argv`` launching the job on ``layout``.
        log: prints one line for the user (stderr).
        popen, clock, sleep: injectable for tests.
    """

    def __init__(self, options: DriverOptions, discover: Callable[[], dict[str, int]],
                 blacklist: Blacklist, command_for: Callable[[list[HostSlots]], list[str]],
                 log: Callable[[str], None] | None = None,
                 popen: Callable[..., Any] = subprocess.Popen,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.options = options
        self.discover = discover
        self.blacklist = blacklist
        self.command_for = command_for
        self.log = log or (lambda line: print(f"mpitrainrun: {line}", file=sys.stderr,
                                              flush=True))
        self.popen = popen
        self.clock = clock
        self.sleep = sleep
        self.order: list[str] = []
        self.launches: list[list[HostSlots]] = []  # every layout started, for the record

    def run(self) -> int:
        """The driver loop; returns the exit status for mpitrainrun."""
        try:
            return self._loop()
        finally:
            shutil.rmtree(self.options.control_dir, ignore_errors=True)

    def _loop(self) -> int:
        failures = 0
        while True:
            limit = self.options.np if not self.launches else self.options.max_np
            layout = self.wait_for_hosts(limit)
            if layout is None:
                return 1
            outcome = self.launch(layout)
            if outcome.stopped_to_grow:
                continue
            if outcome.code == 0:
                self._remove_state_file()
                return 0
            if failures >= self.options.restarts:
                self.log(f"the job failed (exit {outcome.code}) and was restarted {failures} "
                         f"time(s), the --reset-limit; giving up (its last commit is in "
                         f"{self.options.state_file})")
                return outcome.code
            failures += 1
            resume = ("from its last commit" if os.path.exists(self.options.state_file)
                      else "from the start (no commit was written)")
            self.log(f"the job failed (exit {outcome.code}); restarting it {resume} "
                     f"({failures} of {self.options.restarts})")

    def usable_layout(self, hosts: dict[str, int], limit: int) -> list[HostSlots]:
        """Where ``limit`` ranks would go now: discovered hosts minus the blacklist."""
        usable = {h: s for h, s in hosts.items() if not self.blacklist.blocks(h)}
        self.order = order_hosts(list(usable), self.order)
        return place(usable, self.order, limit)

    def wait_for_hosts(self, limit: int) -> list[HostSlots] | None:
        """A layout of at least --min-np ranks, or None (said why) after --elastic-timeout."""
        deadline = self.clock() + self.options.elastic_timeout_s
        waiting_said = False
        while True:
            try:
                layout = self.usable_layout(self.discover(), limit)
            except DiscoveryError as exc:
                if not self.launches:
                    self.log(f"error: {exc}")
                    return None
                self.log(f"warning: {exc}; trying again")
                layout = []
            found = sum(h.slots for h in layout)
            if found >= self.options.min_np:
                return layout
            if self.clock() >= deadline:
                self.log(f"only {found} slot(s) available (blacklisted: "
                         f"{self.blacklist.blocked() or 'none'}), fewer than --min-np "
                         f"{self.options.min_np}, for {self.options.elastic_timeout_s:g} s; "
                         "giving up")
                return None
            if not waiting_said:
                self.log(f"waiting for --min-np {self.options.min_np} slots ({found} "
                         "available now)")
                waiting_said = True
            self.sleep(self.options.interval_s)

    def launch(self, layout: list[HostSlots]) -> Outcome:
        """Run the job once on ``layout``, watching the hosts while it runs."""
        directory = self.options.control_dir
        elastic_control.reset(directory)
        self.launches.append(layout)
        size = sum(h.slots for h in layout)
        self.log(f"starting {size} rank(s) on {', '.join(f'{h.host}:{h.slots}' for h in layout)}")
        live = {h.host: h.slots for h in layout}
        proc = self.popen(self.command_for(layout), stderr=subprocess.PIPE, text=True)
        output = _Tee(proc.stderr)
        lost: list[str] = []
        seen = 0
        notified = False
        with forwarding_signals(proc):
            while not _ends_within(proc, self.options.interval_s):
                events = elastic_control.read_events(directory)
                for host in self._lost_hosts(events[seen:], layout):
                    live[host] -= 1
                    self._blacklist(host, lost)
                seen = len(events)
                if not notified:
                    notified = self._notify_if_hosts_changed(live)
        output.join()
        events = elastic_control.read_events(directory)
        for host in self._lost_hosts(events[seen:], layout):
            self._blacklist(host, lost)
        stopped = any(e["event"] == "stopping" for e in events)
        if proc.returncode != 0 and not stopped:
            for rank in failed_ranks(output.text()):
                failed = host_of_rank(layout, rank)
                if failed is not None:
                    self._blacklist(failed, lost)
        if stopped:
            self.log("the job stopped at a commit to use the new hosts; restarting it there")
        return Outcome(proc.returncode, stopped, lost)

    def _lost_hosts(self, events: list[dict[str, Any]], layout: list[HostSlots]) -> list[str]:
        """The layout hosts of the ranks that ``lost`` events name, once per lost rank; each
        loss is also said here, since a launcher may no longer forward the job's own output
        once a host is gone (Open MPI 5.0.11 does not)."""
        hosts: list[str] = []
        for event in events:
            if event["event"] != "lost":
                continue
            lost = [(int(r), host_of_rank(layout, int(r))) for r in event["ranks"]]
            hosts.extend(h for _, h in lost if h is not None)
            self.log(f"the job lost world rank(s) {[r for r, _ in lost]} on host(s) "
                     f"{sorted({h or '?' for _, h in lost})}; it continues in place on "
                     f"{event.get('size', '?')} rank(s)")
        return hosts

    def _notify_if_hosts_changed(self, live: dict[str, int]) -> bool:
        """Tell the job to stop at its next commit if the hosts now offer it more ranks, or a
        host it runs on left the list; True once told."""
        try:
            hosts = self.discover()
        except DiscoveryError as exc:
            self.log(f"warning: {exc}; keeping the hosts as they were")
            return False
        update = 0
        gone = sorted(h for h, n in live.items() if n > 0 and h not in hosts)
        if gone:
            update |= elastic_control.REMOVED
        now = sum(n for n in live.values() if n > 0)
        could = sum(h.slots for h in self.usable_layout(hosts, self.options.max_np))
        if could > now:
            update |= elastic_control.ADDED
        if not update:
            return False
        what = (f"host(s) {gone} left the list" if gone else "") + \
            ("; " if gone and could > now else "") + \
            (f"{could} rank(s) could run where {now} do" if could > now else "")
        self.log(f"hosts changed ({what}); the job restarts on them at its next commit")
        elastic_control.write_notice(self.options.control_dir, time.time(), update)
        return True

    def _blacklist(self, host: str, already: list[str]) -> None:
        if host in already:
            return
        already.append(host)
        delay = self.blacklist.add(host)
        self.log(f"blacklisting host {host} (a rank failed there)" +
                 (f" for {delay:.0f} s" if delay is not None else ""))

    def _remove_state_file(self) -> None:
        if not self.options.keep_state_file and os.path.exists(self.options.state_file):
            os.unlink(self.options.state_file)


def _ends_within(proc: Any, seconds: float) -> bool:
    """Whether the launched job ends within ``seconds`` (waiting at most that long)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True


class _Tee:
    """Copies the job's stderr to ours as it comes, keeping the last 64 KiB to read the
    launcher's failure report from."""

    def __init__(self, stream: Any) -> None:
        self._chunks: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        if stream is None:
            return
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            self._chunks.append(line)
            while len(self._chunks) > 1 and sum(map(len, self._chunks)) > 65536:
                self._chunks.pop(0)

    def join(self) -> None:
        self._thread.join(timeout=10)

    def text(self) -> str:
        return "".join(self._chunks)


def layout_string(layout: Sequence[HostSlots]) -> str:
    """``node1:2,node2:2``, the -H form."""
    return ",".join(f"{h.host}:{h.slots}" for h in layout)


__all__ = ["DriverOptions", "ElasticDriver", "failed_ranks", "host_of_rank", "layout_string"]
