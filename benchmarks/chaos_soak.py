#!/usr/bin/env python3
"""Chaos soak: elastic training on namespace hosts for a given time, under repeated faults.

Builds a cluster of network-namespace hosts (tools/netns_cluster.py: 2 hosts x 2 ranks, or
one host of 4), starts ``benchmarks/chaos_worker.py`` (a CNN on scikit-learn's digits under
``hvd.elastic.run``) through ``mpitrainrun --host-discovery-script`` with Open MPI's ULFM, and
every ``--fault-every`` minutes (+-30%) injects the next fault of ``--faults``, in turn:

* ``kill``: SIGKILL of a random rank at a random moment (from outside);
* ``collective`` / ``commit``: a rank SIGKILLs itself inside its next step (forward, backward,
  gradient allreduce) / inside its next commit;
* ``init``: a rank dies inside the next rebuild's init(), which the soak starts by killing
  another rank a moment later (two deaths, the second during the recovery from the first);
* ``host``: the discovery script stops listing a host (or, with one host, half its slots) and
  lists it again after a third of the interval: the job stops at a commit, restarts without
  it, and grows back at a later commit;
* ``link``: a host's link is shaped down (tbf, ``--link-rate``) for a third of the interval.

A killed rank's host is blacklisted by mpitrainrun for 20-40 s, so the job also grows back to
4 ranks by restart after each kill.  Every ``--sample-every`` seconds the soak records the RSS
and open file descriptors of every rank and the entries of /dev/shm.  At the end it asks the
job to stop (a file the ranks check at each commit), waits for it (a job that does not end is
reported as a hang and killed), then checks and writes (``RUNDIR/chaos_soak.json`` and
``.png``): faults injected and recovered, time to recover (fault to the first commit after the
survivors' reset or the job's restart; median and max), steps lost (reached minus restored),
RSS and descriptor growth per process after a warm-up, /dev/shm entries left behind, the final
parameters of every rank (identical?), and the loss at the start and the end.

Needs root, ``ip``, ``tc`` and ``unshare``; run from a checkout with its .venv::

    sudo .venv/bin/python benchmarks/chaos_soak.py --minutes 60 --fault-every 5
    .venv/bin/python benchmarks/chaos_soak.py --minutes 1.5 --fault-every 0.4 \\
        --faults kill,commit --rundir /tmp/soak      # the short version CI runs

Exit status 0 when every check passed, 1 otherwise (the JSON says which failed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "chaos_worker.py"
FAULTS = ("kill", "collective", "commit", "init", "host", "link")
WARM_UP_S = 60.0  # RSS and descriptors are judged after each process's first minute
COMMIT_EVERY = 5  # as in chaos_worker.py


def _netns() -> Any:
    spec = importlib.util.spec_from_file_location("netns_cluster",
                                                  ROOT / "tools" / "netns_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["netns_cluster"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="chaos_soak.py", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0,
                        help="how long to train under faults (default 60)")
    parser.add_argument("--fault-every", type=float, default=5.0, metavar="MINUTES",
                        help="minutes between faults, each +-30%% (default 5)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"faults to inject, in turn (default {','.join(FAULTS)})")
    parser.add_argument("--layout", choices=("2x2", "1x4"), default="2x2",
                        help="2 hosts of 2 ranks, or 1 host of 4 (default 2x2)")
    parser.add_argument("--name", default="chsoak",
                        help="cluster name: prefix of namespaces and links, <= 10 characters")
    parser.add_argument("--rundir", type=Path, default=Path("chaos_soak_run"),
                        help="where the logs, the JSON and the plot go (default ./chaos_soak_run)")
    parser.add_argument("--link-rate", default="20mbit", help="a shaped link's rate")
    parser.add_argument("--sample-every", type=float, default=2.0, metavar="SECONDS",
                        help="RSS / descriptor / /dev/shm sampling interval (default 2)")
    parser.add_argument("--step-sleep", type=float, default=0.05, metavar="SECONDS",
                        help="sleep per training step, to leave the machine some CPU")
    parser.add_argument("--stop-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="how long the job may take to end once asked (else: a hang)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    args = parser.parse_args(argv)
    unknown = set(args.faults.split(",")) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    return args


# ------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def workers(rundir: Path) -> list[int]:
    """Live processes of this soak's job: chaos_worker.py with this run directory."""
    mine = str(rundir)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        # python chaos_worker.py RUNDIR: not the launcher nor mpirun, whose argv name it too.
        if len(argv) > 2 and argv[1].endswith("chaos_worker.py") and argv[2] == mine:
            found.append(int(entry))
    return sorted(found)


def sample(pid: int) -> dict[str, Any] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return {"pid": pid, "rss_kb": rss, "fds": fds}


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


# ------------------------------------------------------------------------- the logs
def read_events(rundir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted((rundir / "workers").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def started_pids(events: Iterable[dict[str, Any]]) -> dict[int, float]:
    """pid -> time its init() returned."""
    return {e["pid"]: e["t"] for e in events if e["event"] == "init"}


# ------------------------------------------------------------------------- the soak
class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rundir = args.rundir.resolve()
        self.rng = random.Random(args.seed)
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.shm: list[dict[str, Any]] = []
        self.restore: list[tuple[float, Any]] = []  # (when, what to undo)
        netns = _netns()
        hosts, slots = (2, 2) if args.layout == "2x2" else (1, 4)
        self.cluster = netns.Cluster(args.name, hosts, slots)
        self.launch_env = netns.launch_env
        self.missing = netns.missing_requirements

    # ---------------------------------------------------------------- set-up
    def hosts_file(self, listing: dict[str, int]) -> None:
        tmp = self.rundir / "hosts.tmp"
        tmp.write_text("".join(f"{h}:{n}\n" for h, n in listing.items()))
        os.replace(tmp, self.rundir / "hosts")

    def full_listing(self) -> dict[str, int]:
        return {h: self.cluster.slots for h in self.cluster.hostnames}

    def command(self) -> list[str]:
        discover = self.rundir / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {shlex.quote(str(self.rundir / 'hosts'))}\n")
        discover.chmod(0o755)
        return [sys.executable, "-m", "mpitrain.runner.launch", "-np", "4", "--min-np", "2",
                "--max-np", "4", "--host-discovery-script", str(discover),
                "--discovery-interval", "1", "--blacklist-cooldown-range", "20", "40",
                "--reset-limit", "1000", "--elastic-timeout", "120",
                "--elastic-state-file", str(self.rundir / "state.pkl"), "--mpi", "openmpi",
                "--mpi-args=" + shlex.join(self.cluster.mpi_args()),
                sys.executable, str(WORKER), str(self.rundir),
                "--step-sleep", str(self.args.step_sleep)]

    # ---------------------------------------------------------------- faults
    def live(self) -> list[int]:
        """Ranks that are training and not already doomed (an order not yet carried out: its
        rank dies at its next step or commit, so it must not count as a survivor)."""
        events = read_events(self.rundir)
        running = started_pids(events)
        done = {e["pid"] for e in events if e["event"] in ("done", "dying")}
        doomed = {int(p.name) for p in (self.rundir / "orders").glob("*")}
        doomed |= {e["pid"] for e in events if e["event"] == "order"}
        return [p for p in workers(self.rundir)
                if p in running and p not in done and p not in doomed]

    def inject(self, kind: str, now: float) -> None:
        live = self.live()
        record: dict[str, Any] = {"t": time.time(), "kind": kind}
        if kind in ("kill", "collective", "commit", "init") and len(live) < 3:
            record["skipped"] = f"{len(live)} ranks running; a kill would go below --min-np"
        elif kind == "kill":
            victim = self.rng.choice(live)
            record["pid"] = victim
            os.kill(victim, signal.SIGKILL)
        elif kind in ("collective", "commit", "init"):
            victim = self.rng.choice(live)
            record["pid"] = victim
            (self.rundir / "orders").mkdir(exist_ok=True)
            (self.rundir / "orders" / str(victim)).write_text(kind)
            if kind == "init":  # start a rebuild: the ordered rank dies inside its init()
                time.sleep(2.0)
                trigger = self.rng.choice([p for p in live if p != victim])
                record["trigger_pid"] = trigger
                with contextlib.suppress(ProcessLookupError):
                    os.kill(trigger, signal.SIGKILL)
        elif kind == "host":
            listing = self.full_listing()
            if len(listing) > 1:
                gone = self.cluster.hostnames[-1]
                del listing[gone]
                record["host"] = gone
            else:
                host = self.cluster.hostnames[0]
                listing[host] = self.cluster.slots // 2
                record["host"] = f"{host}: {self.cluster.slots} -> {listing[host]} slots"
            self.hosts_file(listing)
            self.restore.append((now + self.args.fault_every * 20, "hosts"))
        elif kind == "link":
            if self.cluster.hosts < 2:
                record["skipped"] = "one host: no link between hosts to shape"
            else:
                host = self.cluster.hostnames[-1]
                subprocess.run(["ip", "netns", "exec", host, "tc", "qdisc", "replace", "dev",
                                "eth0", "root", "tbf", "rate", self.args.link_rate, "burst",
                                "32kb", "latency", "50ms"], check=True, capture_output=True)
                record["host"] = host
                self.restore.append((now + self.args.fault_every * 20, ("link", host)))
        print(f"chaos_soak: {time.strftime('%H:%M:%S')} fault {kind}: "
              f"{ {k: v for k, v in record.items() if k not in ('t', 'kind')} }", flush=True)
        self.faults.append(record)

    def undo_due(self, now: float, force: bool = False) -> None:
        for item in list(self.restore):
            when, what = item
            if now < when and not force:
                continue
            self.restore.remove(item)
            if what == "hosts":
                self.hosts_file(self.full_listing())
                self.faults.append({"t": time.time(), "kind": "host-back"})
            else:
                subprocess.run(["ip", "netns", "exec", what[1], "tc", "qdisc", "del", "dev",
                                "eth0", "root"], capture_output=True)
                self.faults.append({"t": time.time(), "kind": "link-back", "host": what[1]})
            print(f"chaos_soak: {time.strftime('%H:%M:%S')} undone: {what}", flush=True)

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        reason = self.missing(probe=True)
        if reason:
            raise SystemExit(f"chaos_soak: cannot build a namespace cluster: {reason}")
        self.rundir.mkdir(parents=True, exist_ok=True)
        for stale in ("stop", "state.pkl", "hosts"):
            with contextlib.suppress(FileNotFoundError):
                (self.rundir / stale).unlink()
        for directory in ("workers", "orders"):
            for path in (self.rundir / directory).glob("*"):
                path.unlink()
        shm_before = shm_entries()
        kinds = self.args.faults.split(",")
        self.cluster.create()
        launcher = None
        outcome: dict[str, Any] = {}
        try:
            self.hosts_file(self.full_listing())
            log = open(self.rundir / "mpitrainrun.log", "w")  # noqa: SIM115 - closed below
            launcher = subprocess.Popen(self.command(), env=self.launch_env(), cwd=ROOT,
                                        stdout=log, stderr=subprocess.STDOUT)
            started = time.time()
            end = started + self.args.minutes * 60
            gap = self.args.fault_every * 60
            next_fault = started + gap * self.rng.uniform(0.7, 1.3)
            n = 0
            while time.time() < end and launcher.poll() is None:
                now = time.time()
                for pid in workers(self.rundir):
                    row = sample(pid)
                    if row is not None:
                        self.samples.append({"t": now, **row})
                self.shm.append({"t": now, "entries": len([
                    e for e in shm_entries() if f"{self.cluster.name}-node" in e])})
                if now >= next_fault:
                    self.inject(kinds[n % len(kinds)], now)
                    n += 1
                    next_fault = now + gap * self.rng.uniform(0.7, 1.3)
                self.undo_due(now)
                time.sleep(self.args.sample_every)
            outcome["ended_early"] = launcher.poll()
            self.undo_due(time.time(), force=True)
            (self.rundir / "stop").write_text("stop\n")
            asked = time.time()
            try:
                outcome["exit"] = launcher.wait(timeout=self.args.stop_timeout)
                outcome["stop_s"] = round(time.time() - asked, 1)
            except subprocess.TimeoutExpired:
                outcome["exit"] = None
                outcome["hang"] = (f"the job had not ended {self.args.stop_timeout:g} s after "
                                   "it was asked to stop")
            log.close()
        finally:
            if launcher is not None:
                for pid in [*descendants(launcher.pid), launcher.pid]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                launcher.wait()
            time.sleep(1.0)
            outcome["left_running"] = workers(self.rundir)
            self.cluster.destroy()
        time.sleep(1.0)
        # Only this job's: Open MPI names its segments after the host (sm_segment.HOST...),
        # and other jobs on this machine may come and go meanwhile.
        outcome["shm_left"] = sorted(e for e in shm_entries() - shm_before
                                     if f"{self.cluster.name}-node" in e)
        return outcome

    # ---------------------------------------------------------------- the verdict
    def report(self, outcome: dict[str, Any]) -> dict[str, Any]:
        events = read_events(self.rundir)
        commits = [e for e in events if e["event"] == "commit"]
        steps = [e for e in events if e["event"] == "step"]
        recoveries, lost = [], []
        injected = [f for f in self.faults if f["kind"] in FAULTS and "skipped" not in f]
        for fault in injected:
            t0 = fault["t"]
            if fault["kind"] == "link":
                continue  # nothing to recover from: judged by the step times
            noticed = next((e for e in events if e["t"] > t0 and
                            e["event"] in ("reset", "init")), None)
            if noticed is None:
                fault["recovered"] = False
                continue
            back = next((e for e in commits if e["t"] > noticed["t"]), None)
            fault["recovered"] = back is not None
            if back is None:
                continue
            fault["recovery_s"] = round(back["t"] - t0, 2)
            recoveries.append(back["t"] - t0)
            reached = max((e["step"] for e in commits + steps if e["t"] <= t0), default=0)
            resets = [e["restored"] for e in events if e["event"] == "reset"
                      and t0 < e["t"] <= back["t"]]
            restored = min(resets) if resets else back["step"] - COMMIT_EVERY
            fault["steps_lost"] = max(0, reached - restored)
            lost.append(fault["steps_lost"])
        done = [e for e in events if e["event"] == "done"]
        losses = [e["loss"] for e in steps]
        tenth = max(1, len(losses) // 10)
        growth = self.growth()
        summary = {
            "faults_injected": len(injected),
            "faults_recovered": sum(1 for f in injected if f.get("recovered")),
            "faults_not_recoverable": [f["kind"] for f in injected if f["kind"] == "link"],
            "recovery_s_median": round(statistics.median(recoveries), 2) if recoveries else None,
            "recovery_s_max": round(max(recoveries), 2) if recoveries else None,
            "steps_lost_total": sum(lost), "steps_lost_max": max(lost, default=0),
            "steps": max((e["step"] for e in commits), default=0),
            "hang": outcome.get("hang"),
            "exit_status": outcome.get("exit"),
            "final_ranks": len(done),
            "final_params_identical": len({e["params"] for e in done}) == 1 if done else False,
            "loss_first": round(statistics.mean(losses[:tenth]), 4) if losses else None,
            "loss_last": round(statistics.mean(losses[-tenth:]), 4) if losses else None,
            "rss_growth_kb_per_min_max": growth["rss"],
            "fd_peak_growth": growth["fds"],
            "shm_left": outcome.get("shm_left"),
            "processes_left": outcome.get("left_running"),
        }
        checks = {
            "no hang": not summary["hang"] and summary["exit_status"] == 0,
            "every fault recovered": summary["faults_recovered"] == summary["faults_injected"]
            - len(summary["faults_not_recoverable"]),
            "identical final parameters": summary["final_params_identical"],
            "loss went down": (summary["loss_first"] is not None
                               and summary["loss_last"] < summary["loss_first"]),
            # A slope left by the last minutes of noise, not a leak: 2 MiB per minute, i.e.
            # 120 MiB over an hour, would be caught.
            "RSS flat after warm-up": growth["rss"] is None or growth["rss"] < 2048,
            "descriptors flat over the run": growth["fds"] is None or growth["fds"] <= 4,
            "nothing left in /dev/shm": not summary["shm_left"],
            "no process left": not summary["processes_left"],
        }
        return {"config": {k: (str(v) if isinstance(v, Path) else v)
                           for k, v in vars(self.args).items()},
                "summary": summary, "checks": checks, "faults": self.faults,
                "samples": self.samples, "shm": self.shm,
                "steps": [{"t": e["t"], "step": e["step"], "seconds": e["seconds"],
                           "loss": e["loss"], "size": e["size"]} for e in steps]}

    def growth(self) -> dict[str, float | None]:
        """RSS: the largest least-squares slope of any process after its warm-up (KiB per
        minute).  Descriptors: how much the peak count of the last third's processes exceeds
        the first third's.  Not each process's max - min: a rank's count rises and falls by
        a dozen as the job shrinks and grows around it (connections to the ranks that come
        and go), and after every fault the job is restarted, so no process lives long
        enough to show a per-rebuild leak on its own; one would show as peaks that climb
        over the hour."""
        by_pid: dict[int, list[dict[str, Any]]] = {}
        for row in self.samples:
            by_pid.setdefault(row["pid"], []).append(row)
        slopes, peaks = [], []
        for rows in by_pid.values():
            peaks.append((rows[0]["t"], max(r["fds"] for r in rows)))
            late = [r for r in rows if r["t"] - rows[0]["t"] >= WARM_UP_S]
            if len(late) < 10:
                continue
            t = [r["t"] / 60 for r in late]
            y = [r["rss_kb"] for r in late]
            mt, my = statistics.mean(t), statistics.mean(y)
            var = sum((a - mt) ** 2 for a in t)
            if var > 0:
                slopes.append(sum((a - mt) * (b - my) for a, b in zip(t, y)) / var)
        peaks.sort()
        third = len(peaks) // 3
        fds = (max(p for _, p in peaks[-third:]) - max(p for _, p in peaks[:third])
               if third else None)
        return {"rss": round(max(slopes), 1) if slopes else None, "fds": fds}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib  # only for the figure, at the end

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the file backend

    t0 = min([s["t"] for s in result["samples"]] + [s["t"] for s in result["steps"]],
             default=0.0)
    fig, (rss_ax, step_ax) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for row in result["samples"]:
        by_pid.setdefault(row["pid"], []).append(row)
    for rows in by_pid.values():
        rss_ax.plot([(r["t"] - t0) / 60 for r in rows], [r["rss_kb"] / 1024 for r in rows],
                    linewidth=0.8)
    rss_ax.set_ylabel("RSS per rank (MiB)")
    rss_ax.set_title(f"chaos soak: {result['config']['layout']}, "
                     f"{result['config']['minutes']:g} min, "
                     f"{result['summary']['faults_injected']} faults")
    steps = result["steps"]
    step_ax.plot([(s["t"] - t0) / 60 for s in steps], [s["seconds"] * 1e3 for s in steps],
                 ".", markersize=1.5)
    step_ax.set_yscale("log")
    step_ax.set_ylabel("step time, rank 0 (ms)")
    step_ax.set_xlabel("minutes")
    colours = {"kill": "red", "collective": "darkred", "commit": "orange", "init": "purple",
               "host": "blue", "host-back": "cyan", "link": "green", "link-back": "lime"}
    for fault in result["faults"]:
        if "skipped" in fault:
            continue
        for ax in (rss_ax, step_ax):
            ax.axvline((fault["t"] - t0) / 60, color=colours.get(fault["kind"], "grey"),
                       linewidth=0.7, alpha=0.7)
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in colours.items()]
    rss_ax.legend(handles=handles, fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Stopped from outside (kill, a CI timeout): end through run()'s cleanup, which kills the
    # job and removes the cluster, instead of leaving both behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    soak = Soak(args)
    outcome = soak.run()
    result = soak.report(outcome)
    rundir = soak.rundir
    (rundir / "chaos_soak.json").write_text(json.dumps(result, indent=1))
    plot(result, rundir / "chaos_soak.png")
    print(json.dumps(result["summary"], indent=1))
    failed = [name for name, ok in result["checks"].items() if not ok]
    print("chaos_soak: " + ("every check passed" if not failed else
                            f"FAILED: {', '.join(failed)}") +
          f" (results in {rundir / 'chaos_soak.json'}, plot {rundir / 'chaos_soak.png'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
