"""``mpitrainrun``: start an mpitrain job with the right MPI command, the way horovodrun does.

Examples::

    mpitrainrun -np 4 python train.py                         # this machine
    mpitrainrun -np 8 -H node1:4,node2:4 python train.py      # two hosts over ssh
    mpitrainrun -np 16 --hostfile hosts -npernode 8 python train.py
    mpitrainrun -np 8 --dry-run python train.py               # print the command only
    mpitrainrun --check-build                                 # what this install supports

Where the hosts come from, in order: ``-H``, ``--hostfile``, the scheduler allocation this
command runs inside (Slurm: ``srun`` is used, no hostfile; PBS and LSF: their node files), and
otherwise this machine alone, whose slots are its cores.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import config
from . import allocation, build_info
from .hosts import HostfileError, HostSlots, parse_hosts_string, place, read_hostfile, with_slots
from .mpi_command import (
    SRUN_MPI_PLUGINS,
    Flavor,
    LaunchSpec,
    build_command,
    build_srun,
    detect_flavor,
    find_launcher,
    forwarded_names,
)

_NAMES = {var.field: var.name for var in config.VARIABLES}
_OVERSUBSCRIBE_FLAGS = ("--oversubscribe", "-oversubscribe")


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _pos_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpitrainrun", allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Launch an mpitrain job: builds the Open MPI, MPICH, Intel MPI or srun "
                    "command with one process per slot, consecutive ranks on the same host, "
                    "and the MPITRAIN_* settings below passed to every rank.",
        epilog="examples:\n"
               "  mpitrainrun -np 4 python train.py\n"
               "  mpitrainrun -np 8 -H node1:4,node2:4 python train.py\n"
               "  mpitrainrun -np 16 --hostfile hosts -npernode 8 --dry-run python train.py\n"
               "  mpitrainrun -np 4 --mpi-args='--mca btl tcp,self' python train.py\n"
               "  mpitrainrun --check-build\n\n"
               "Inside a Slurm allocation (no -H/--hostfile) the job runs through srun, with\n"
               "--mpi=pmix for Open MPI or --mpi=pmi2 for MPICH unless SLURM_MPI_TYPE or\n"
               "--mpi-args='--mpi=...' chooses; in a\n"
               "PBS or LSF job, on the allocation's node file.  Without any of these it runs\n"
               "on this machine, whose slots are its cores (give -H localhost:N to run more).")
    where = parser.add_argument_group("processes and hosts")
    where.add_argument("-np", "--num-proc", dest="np", type=_pos_int, metavar="N",
                       help="number of processes (ranks) to start")
    hosts = where.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST[:SLOTS],...",
                       help="hosts and their slots, e.g. node1:4,node2:4 (a host without :SLOTS "
                            "has 1 slot, as in horovodrun)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="hostfile in Open MPI ('host slots=N'), MPICH ('host:N') or "
                            "one-line-per-slot form (see mpitrain-hostfile)")
    where.add_argument("-npernode", "--npernode", "--slots-per-host", dest="npernode",
                       type=_pos_int, metavar="K",
                       help="run K processes on each host, whatever slots the host list gives")
    where.add_argument("--network-interface", metavar="IF",
                       help="interface (or Open MPI subnet) for MPI traffic, e.g. eth0 or "
                            "10.0.0.0/24")
    where.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                       help="auto: srun inside a Slurm allocation, mpirun otherwise")
    where.add_argument("--mpi", choices=("auto", "openmpi", "mpich", "intel"), default="auto",
                       help="which MPI the launcher belongs to (auto: ask it --version)")
    where.add_argument("--mpirun", metavar="PATH",
                       help="the mpirun/mpiexec to use (default: the one next to this Python, "
                            "else mpirun or mpiexec on PATH)")
    where.add_argument("--mpi-args", default="", metavar="'ARGS'",
                       help="extra arguments for the launcher, one quoted string; write "
                            "--mpi-args='--oversubscribe' (with '=') when it starts with '-'")

    tuning = parser.add_argument_group("mpitrain settings (passed to every rank)")
    tuning.add_argument("--fusion-threshold-mb", type=_nonneg_float, metavar="MB",
                        help="fused bucket size in MiB; 0 disables fusion")
    tuning.add_argument("--cycle-time-ms", type=_nonneg_float, metavar="MS",
                        help="milliseconds between negotiation cycles")
    tuning.add_argument("--cache-capacity", type=_nonneg_int, metavar="N",
                        help="negotiated requests remembered; 0 disables the cache")
    tuning.add_argument("--streams", type=_pos_int, metavar="N",
                        help="parallel channels a large allreduce is split across")
    tuning.add_argument("--hierarchical-allreduce", action="store_true",
                        help="prefer the hierarchical allreduce across nodes")
    tuning.add_argument("--allreduce-algorithm", choices=config.ALLREDUCE_ALGORITHMS,
                        help="force one allreduce algorithm")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline (from rank 0) to FILE")
    tuning.add_argument("--timeline-mark-cycles", action="store_true",
                        help="mark every negotiation cycle in the timeline")
    tuning.add_argument("--no-stall-check", action="store_true",
                        help="turn the stall inspector off")
    tuning.add_argument("--stall-check-warning-time-seconds", type=_nonneg_float, metavar="S",
                        help="warn when ranks have waited S seconds for the others")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=_nonneg_float,
                        metavar="S", help="end the job after S seconds of stall (0: never)")
    tuning.add_argument("--log-level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR",
                                                "FATAL"), help="mpitrain's log level")
    tuning.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="also pass NAME=VALUE (or NAME's current value) to every rank; "
                             "repeatable")

    mode = parser.add_argument_group("what to do")
    mode.add_argument("--dry-run", action="store_true",
                      help="print the command that would run, run nothing")
    mode.add_argument("--check-build", action="store_true",
                      help="show what this installation supports (MPI library and thread "
                           "level, CUDA, cupy, numba, CUDA-aware MPI) and exit")
    mode.add_argument("--verbose", action="store_true",
                      help="print the placement and the command before running it")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program and its arguments, e.g. python train.py --lr 0.1")
    return parser


def settings_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The MPITRAIN_* variables the command line asks for, in a fixed order."""
    out: dict[str, str] = {}
    if args.fusion_threshold_mb is not None:
        out[_NAMES["fusion_threshold"]] = str(int(args.fusion_threshold_mb * config.MiB))
    if args.cycle_time_ms is not None:
        out[_NAMES["cycle_time_ms"]] = f"{args.cycle_time_ms:g}"
    if args.cache_capacity is not None:
        out[_NAMES["cache_capacity"]] = str(args.cache_capacity)
    if args.streams is not None:
        out[_NAMES["allreduce_streams"]] = str(args.streams)
    if args.hierarchical_allreduce:
        out[_NAMES["hierarchical_allreduce"]] = "1"
    if args.allreduce_algorithm is not None:
        out[_NAMES["allreduce_algorithm"]] = args.allreduce_algorithm
    if args.timeline_filename:
        out[_NAMES["timeline"]] = os.path.abspath(args.timeline_filename)
    if args.timeline_mark_cycles:
        out[_NAMES["timeline_mark_cycles"]] = "1"
    if args.no_stall_check:
        out[_NAMES["stall_check_disable"]] = "1"
    if args.stall_check_warning_time_seconds is not None:
        out[_NAMES["stall_check_time_seconds"]] = f"{args.stall_check_warning_time_seconds:g}"
    if args.stall_check_shutdown_time_seconds is not None:
        out[_NAMES["stall_shutdown_time_seconds"]] = \
            f"{args.stall_check_shutdown_time_seconds:g}"
    if args.log_level is not None:
        out[_NAMES["log_level"]] = args.log_level
    return out


def _user_env(items: Sequence[str], environ: Mapping[str, str]) -> tuple[dict[str, str],
                                                                        list[str]]:
    """Split ``-x`` items into NAME=VALUE settings and names forwarded with their value."""
    settings: dict[str, str] = {}
    names: list[str] = []
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or \
                not all(c.isalnum() or c == "_" for c in name):
            raise ValueError(f"-x {item!r}: {name!r} is not an environment variable name")
        if sep:
            settings[name] = value
        elif name in environ:
            names.append(name)
        else:
            raise ValueError(f"-x {name}: {name} is not set here, so there is no value to pass")
    return settings, names


@dataclass
class Plan:
    """What mpitrainrun decided: the argv and a description for --verbose."""

    argv: list[str]
    placement: str
    hosts_to_resolve: list[str]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _is_this_machine(host: str) -> bool:
    return host in ("localhost", socket.gethostname()) or host.startswith("127.")


def _host_source(args: argparse.Namespace, environ: Mapping[str, str]
                 ) -> tuple[list[HostSlots] | None, allocation.Allocation | None]:
    if args.hosts is not None:
        return parse_hosts_string(args.hosts), None
    if args.hostfile is not None:
        return read_hostfile(args.hostfile), None
    found = allocation.detect(environ)
    if found is None:
        return None, None
    return list(found.hosts), found


def make_plan(args: argparse.Namespace, environ: Mapping[str, str], flavor: Flavor | None,
              launcher: str | None, cores: int, as_root: bool,
              srun: str | None = None) -> Plan:
    """Decide the launch command; pure apart from reading a hostfile.

    Raises:
        ValueError: a malformed host list, more processes than slots, bad -x items, or no
            command.
    """
    if not args.command:
        raise ValueError("no command to run; e.g. mpitrainrun -np 2 python train.py")
    if args.np is None:
        raise ValueError("-np N is required: how many processes to start")
    mpi_args = shlex.split(args.mpi_args)
    oversubscribe = any(a in _OVERSUBSCRIBE_FLAGS for a in mpi_args)
    settings, extra_names = _user_env(args.env, environ)
    settings = {**settings_from_args(args), **settings}
    hosts, alloc = _host_source(args, environ)
    if hosts is not None and args.npernode is not None:
        hosts = with_slots(hosts, args.npernode)

    spec = LaunchSpec(np=args.np, command=list(args.command), npernode=args.npernode,
                      settings=settings, network_interface=args.network_interface,
                      mpi_args=mpi_args, as_root=as_root)
    spec.forward = forwarded_names(environ) + [n for n in extra_names
                                               if n not in forwarded_names(environ)]

    use_srun = (alloc is not None and alloc.scheduler == "slurm" and args.launcher != "mpirun"
                and (args.launcher == "srun" or srun is not None))
    if args.launcher == "srun" and not use_srun:
        raise ValueError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID and "
                         "SLURM_JOB_NODELIST) and no -H/--hostfile")
    if hosts is None:
        if args.np > cores and not oversubscribe:
            raise ValueError(f"-np {args.np} asks for more processes than the {cores} cores of "
                             f"this machine; lower -np, or oversubscribe on purpose with "
                             f"-H localhost:{args.np}")
        spec.yield_when_idle = args.np > cores
        placement = f"{args.np} process(es) on this machine ({cores} cores)"
        if flavor is None or launcher is None:
            raise ValueError("no MPI launcher")
        return Plan(build_command(flavor, launcher, spec), placement, [])

    placed = list(hosts) if oversubscribe else place(args.np, hosts)
    # Ranks beyond this machine's cores (e.g. -H localhost:16): ask MPI not to busy-poll.
    spec.yield_when_idle = any(_is_this_machine(h.host) and h.slots > cores for h in placed)
    placement = ", ".join(f"{h.host}:{h.slots}" for h in placed)
    if alloc is not None:
        placement = f"{alloc.scheduler} allocation: {placement}"
    if use_srun:
        spec.srun_mpi = _srun_mpi_plugin(flavor, environ, mpi_args)
        return Plan(build_srun(spec, srun or "srun"), placement, [])
    if alloc is not None and alloc.scheduler == "slurm":
        # mpirun reads the Slurm allocation itself; only the count is ours to give.
        spec.hosts = None
    else:
        spec.hosts = placed
    if flavor is None or launcher is None:
        raise ValueError("no MPI launcher")
    to_resolve = [h.host for h in placed] if alloc is None else []
    return Plan(build_command(flavor, launcher, spec), placement, to_resolve)


def _srun_mpi_plugin(flavor: Flavor | None, environ: Mapping[str, str],
                     mpi_args: Sequence[str]) -> str | None:
    """srun's ``--mpi=`` for the library, unless the user chose one (SLURM_MPI_TYPE, --mpi)."""
    chosen = "SLURM_MPI_TYPE" in environ or any(a == "--mpi" or a.startswith("--mpi=")
                                                for a in mpi_args)
    return None if chosen or flavor is None else SRUN_MPI_PLUGINS.get(flavor)


def _installed_flavor(environ: Mapping[str, str]) -> Flavor | None:
    """The flavor of the mpirun this Python would use, or None when there is none to ask."""
    try:
        return detect_flavor(find_launcher(environ))
    except (FileNotFoundError, ValueError):
        return None


def check_hosts_resolve(hosts: Sequence[str]) -> None:
    """Raise ValueError naming the first host that does not resolve to an address."""
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
        except OSError as exc:
            raise ValueError(f"host {host!r} does not resolve ({exc.strerror or exc}); check "
                             "the name, /etc/hosts or DNS") from None


def _run(argv: list[str]) -> int:
    """Run the launcher, passing SIGINT/SIGTERM on to it, and return its exit code."""
    proc = subprocess.Popen(argv)

    def forward(signum: int, _frame: Any) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _default_launcher(mpi: str, environ: Mapping[str, str]) -> str:
    try:
        return find_launcher(environ)
    except FileNotFoundError:
        if mpi == "auto":
            raise
        # The flavor was named: its conventional launcher name serves --dry-run anywhere.
        return "mpirun" if mpi == "openmpi" else "mpiexec"


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``mpitrainrun``; returns the job's exit code (2 for usage errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    if args.check_build:
        print(build_info.render(build_info.collect()))
        return 0
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    try:
        hosts_given = args.hosts is not None or args.hostfile is not None
        alloc = None if hosts_given else allocation.detect(env)
        in_slurm = alloc is not None and alloc.scheduler == "slurm"
        srun = shutil.which("srun", path=env.get("PATH")) if in_slurm else None
        use_srun = in_slurm and args.launcher != "mpirun" and (
            srun is not None or args.launcher == "srun")
        launcher: str | None = None
        flavor: Flavor | None = None
        if not use_srun:
            launcher = args.mpirun or _default_launcher(args.mpi, env)
            flavor = Flavor(args.mpi) if args.mpi != "auto" else detect_flavor(launcher)
        else:  # only to pick srun's --mpi= plugin
            flavor = Flavor(args.mpi) if args.mpi != "auto" else _installed_flavor(env)
        as_root = hasattr(os, "geteuid") and os.geteuid() == 0
        plan = make_plan(args, env, flavor, launcher, _cores(), as_root, srun)
        if not args.dry_run:
            check_hosts_resolve(plan.hosts_to_resolve)
    except (ValueError, FileNotFoundError) as exc:
        kind = "hostfile" if isinstance(exc, HostfileError) else "error"
        print(f"mpitrainrun: {kind}: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(plan.argv))
        return 0
    if args.verbose:
        print(f"mpitrainrun: {plan.placement}", file=sys.stderr)
        print(f"mpitrainrun: {shlex.join(plan.argv)}", file=sys.stderr)
    return _run(plan.argv)


if __name__ == "__main__":
    sys.exit(main())
