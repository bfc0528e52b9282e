"""``mpitrainrun``'s command line: its options, and the environment they give every rank.

Separate from :mod:`.launch`, which decides where and how the ranks start: the options are
the user-facing contract (horovodrun's names, kept stable), and they change when a setting is
added, while the launch plan changes when a launcher or a scheduler is.  Like the rest of
``mpitrain.runner`` this imports nothing heavy, so ``mpitrainrun --help`` answers at once.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from ..core import config
from ..core.version import __version__
from . import horovodrun_flags
from .arg_numbers import nonneg_float, nonneg_int, pos_int
from .rdzv_options import add_rendezvous_options

_NAMES = {var.field: var.name for var in config.VARIABLES}


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
               "  mpitrainrun --check-build\n"
               "  mpitrainrun --nnodes 4 --nproc-per-node 8 --rdzv-endpoint node1:29400 "
               "train.py\n"
               "      (once on every node, where a scheduler starts one task per node)\n\n"
               "Inside a Slurm allocation (no -H/--hostfile) the job runs through srun, with\n"
               "--mpi=pmix for Open MPI or --mpi=pmi2 for MPICH unless SLURM_MPI_TYPE or\n"
               "--mpi-args='--mpi=...' chooses; in a\n"
               "PBS or LSF job, on the allocation's node file.  Without any of these it runs\n"
               "on this machine, whose slots are its cores (give -H localhost:N to run more).")
    parser.add_argument("--version", action="version", version=f"mpitrain {__version__}")
    where = parser.add_argument_group("processes and hosts")
    where.add_argument("-np", "--num-proc", dest="np", type=pos_int, metavar="N",
                       help="number of processes (ranks) to start")
    hosts = where.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST[:SLOTS],...",
                       help="hosts and their slots, e.g. node1:4,node2:4 (a host without :SLOTS "
                            "has 1 slot, as in horovodrun)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="hostfile in Open MPI ('host slots=N'), MPICH ('host:N') or "
                            "one-line-per-slot form (see mpitrain-hostfile)")
    where.add_argument("-npernode", "--npernode", "--slots-per-host", dest="npernode",
                       type=pos_int, metavar="K",
                       help="run K processes on each host, whatever slots the host list gives")
    where.add_argument("--network-interface", metavar="IF",
                       help="interface (or Open MPI subnet) for MPI traffic, e.g. eth0 or "
                            "10.0.0.0/24")
    where.add_argument("--launcher", choices=("auto", "mpirun", "srun"), default="auto",
                       help="auto: srun inside a Slurm allocation, mpirun otherwise")
    where.add_argument("--mpi", choices=horovodrun_flags.MPI_CHOICES, default="auto",
                       help="which MPI the launcher belongs to (auto: ask it --version)")
    where.add_argument("--mpirun", metavar="PATH",
                       help="the mpirun/mpiexec to use (default: the one next to this Python, "
                            "else mpirun or mpiexec on PATH)")
    where.add_argument("--mpi-args", default="", metavar="'ARGS'",
                       help="extra arguments for the launcher, one quoted string; write "
                            "--mpi-args='--oversubscribe' (with '=') when it starts with '-'")

    tuning = parser.add_argument_group("mpitrain settings (passed to every rank)")
    tuning.add_argument("--fusion-threshold-mb", type=nonneg_float, metavar="MB",
                        help="fused bucket size in MiB; 0 disables fusion")
    tuning.add_argument("--cycle-time-ms", type=nonneg_float, metavar="MS",
                        help="milliseconds between negotiation cycles")
    tuning.add_argument("--cache-capacity", type=nonneg_int, metavar="N",
                        help="negotiated requests remembered; 0 disables the cache")
    tuning.add_argument("--streams", type=pos_int, metavar="N",
                        help="parallel channels a large allreduce is split across")
    tuning.add_argument("--hierarchical-allreduce", action="store_true",
                        help="prefer the hierarchical allreduce across nodes")
    tuning.add_argument("--allreduce-algorithm", choices=config.ALLREDUCE_ALGORITHMS,
                        help="force one allreduce algorithm")
    # A flag plus a separate mode option, not ``--deterministic [MODE]``: an optional value
    # would swallow the program's name (``--deterministic python train.py``).
    tuning.add_argument("--deterministic", action="store_true",
                        help="floating-point sums with the same bits whatever the fusion, "
                        "algorithm, channels and node layout (MPITRAIN_DETERMINISTIC=1)")
    tuning.add_argument("--deterministic-mode", choices=config.DETERMINISTIC_MODES,
                        help="which deterministic design (implies --deterministic); "
                        "fixed-point also ignores the rank order and world size")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline (from rank 0) to FILE")
    tuning.add_argument("--timeline-mark-cycles", action="store_true",
                        help="mark every negotiation cycle in the timeline")
    tuning.add_argument("--no-stall-check", action="store_true",
                        help="turn the stall inspector off")
    tuning.add_argument("--stall-check-warning-time-seconds", type=nonneg_float, metavar="S",
                        help="warn when ranks have waited S seconds for the others")
    tuning.add_argument("--stall-check-shutdown-time-seconds", type=nonneg_float,
                        metavar="S", help="end the job after S seconds of stall (0: never)")
    tuning.add_argument("--start-timeout", type=nonneg_float, metavar="S",
                        help="every rank must reach init() within S seconds of its start, "
                             "else the job ends naming the ranks that did not (default: no "
                             "limit; MPITRAIN_START_TIMEOUT)")
    tuning.add_argument("--autotune", action="store_true",
                        help="tune fusion threshold, cycle time, allreduce algorithm and "
                             "channels during the first steps, then keep the best")
    tuning.add_argument("--autotune-log-file", metavar="FILE",
                        help="with --autotune: rank 0 writes one CSV row per sample to FILE")
    tuning.add_argument("--autotune-warmup-samples", type=nonneg_int, metavar="N",
                        help="with --autotune: samples discarded before the first trial "
                             "(default 3)")
    tuning.add_argument("--autotune-steps-per-sample", type=pos_int, metavar="N",
                        help="with --autotune: training steps per sample (default 10)")
    tuning.add_argument("--autotune-bayes-opt-max-samples", "--autotune-max-samples",
                        dest="autotune_max_samples", type=pos_int, metavar="N",
                        help="with --autotune: settings tried before the best is frozen "
                             "(default 20)")
    tuning.add_argument("--log-level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR",
                                                "FATAL"), help="mpitrain's log level")
    tuning.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="also pass NAME=VALUE (or NAME's current value) to every rank; "
                             "repeatable")

    elastic = parser.add_argument_group(
        "elastic training (hvd.elastic): with Open MPI 5 the survivors of a lost rank continue "
        "in place (these add --with-ft ulfm); with another MPI, or --elastic-restart, the job "
        "is restarted from its last commit, which rank 0 writes to a state file")
    elastic.add_argument("--min-np", type=pos_int, metavar="N",
                         help="end the job when fewer than N ranks survive a failure")
    elastic.add_argument("--max-np", type=pos_int, metavar="N",
                         help="with --host-discovery-script: grow the job up to N ranks when "
                              "hosts are added (default: -np); without it N must equal -np")
    elastic.add_argument("--reset-limit", type=nonneg_int, metavar="N",
                         help="end the job after N recoveries (0: no limit); in restart mode, "
                              "restart at most N times (default 3)")
    elastic.add_argument("--elastic-restart", action="store_true",
                         help="restart the whole job from its last commit when a rank dies, "
                              "instead of continuing in place (the way without ULFM)")
    elastic.add_argument("--elastic-state-file", metavar="FILE",
                         help="restart mode: where rank 0 writes each commit (default: "
                              ".mpitrain-elastic-<pid>.pkl here, removed when the job "
                              "succeeds; a file you name is kept, and a new job resumes "
                              "from it)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="a shell command printing the usable hosts, one 'host[:slots]' "
                              "per line; run every --discovery-interval seconds. When hosts "
                              "are added (or one in use is removed) the job stops at its next "
                              "commit and is restarted on them from that commit; hosts where "
                              "a rank failed are blacklisted")
    elastic.add_argument("--slots", type=pos_int, default=1, metavar="N",
                         help="slots of a host the discovery script lists without ':slots' "
                              "(default 1)")
    elastic.add_argument("--blacklist-cooldown-range", nargs=2, type=nonneg_int,
                         metavar=("A", "B"),
                         help="use a blacklisted host again after a cooldown: about A seconds "
                              "after its first failure, doubling with each further one, at "
                              "most B (default: never again)")
    elastic.add_argument("--elastic-timeout", type=nonneg_float, default=600.0, metavar="S",
                         help="wait at most S seconds for --min-np slots to be available "
                              "(default 600)")
    elastic.add_argument("--discovery-interval", type=nonneg_float, default=1.0, metavar="S",
                         help="seconds between runs of the discovery script (default 1)")

    add_rendezvous_options(parser)

    mode = parser.add_argument_group("what to do")
    mode.add_argument("--dry-run", action="store_true",
                      help="print the command that would run, run nothing")
    mode.add_argument("-cb", "--check-build", action="store_true",
                      help="show what this installation supports (MPI library and thread "
                           "level, CUDA, cupy, numba, CUDA-aware MPI) and exit")
    mode.add_argument("--verbose", action="store_true",
                      help="print the placement and the command before running it")
    horovodrun_flags.add_flags(parser)
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
    if getattr(args, "deterministic_mode", None):
        out[_NAMES["deterministic"]] = args.deterministic_mode
    elif getattr(args, "deterministic", False):
        out[_NAMES["deterministic"]] = "1"
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
    if args.start_timeout is not None:
        out[_NAMES["start_timeout"]] = f"{args.start_timeout:g}"
    if args.log_level is not None:
        out[_NAMES["log_level"]] = args.log_level
    out.update(_autotune_settings(args))
    if getattr(args, "min_np", None) is not None:
        out[_NAMES["elastic_min_np"]] = str(args.min_np)
    if getattr(args, "reset_limit", None) is not None:
        out[_NAMES["elastic_reset_limit"]] = str(args.reset_limit)
    return out


# Autotune's detail options: (Config field, flag) for each.
_AUTOTUNE_DETAILS = (("autotune_log", "--autotune-log-file"),
                     ("autotune_warmup_samples", "--autotune-warmup-samples"),
                     ("autotune_steps_per_sample", "--autotune-steps-per-sample"),
                     ("autotune_max_samples", "--autotune-bayes-opt-max-samples"))


def _autotune_settings(args: argparse.Namespace) -> dict[str, str]:
    """The autotune variables; a detail option without ``--autotune`` is a mistake.

    Raises:
        ValueError: an --autotune-* option without --autotune.
    """
    given = {(field, flag): value for field, flag in _AUTOTUNE_DETAILS
             if (value := getattr(args, field if field != "autotune_log"
                                  else "autotune_log_file", None)) is not None}
    if not getattr(args, "autotune", False):
        if given:
            flags = ", ".join(flag for _, flag in given)
            raise ValueError(f"{flags} without --autotune: nothing would be tuned; add "
                             "--autotune")
        return {}
    out = {_NAMES["autotune"]: "1"}
    for (field, _), value in given.items():
        out[_NAMES[field]] = os.path.abspath(value) if field == "autotune_log" else str(value)
    return out


def elastic_requested(args: argparse.Namespace) -> bool:
    """Whether the elastic options ask for fault tolerance (checked by :func:`check_elastic`)."""
    return bool(getattr(args, "elastic_restart", False)) or any(
        getattr(args, name, None) is not None
        for name in ("min_np", "max_np", "reset_limit", "host_discovery_script",
                     "blacklist_cooldown_range", "elastic_state_file"))


def check_elastic(args: argparse.Namespace) -> None:
    """Refuse elastic options that contradict each other, saying what to give instead.

    Raises:
        ValueError: --min-np above -np; --max-np below -np, or other than -np without a
            discovery script (only discovered hosts can grow a job); a discovery script
            together with -H/--hostfile; a cooldown range without a discovery script or
            with A > B.
    """
    discovery = args.host_discovery_script is not None
    if args.np is not None and args.min_np is not None and args.min_np > args.np:
        raise ValueError(f"--min-np {args.min_np} is more than -np {args.np}")
    if args.np is not None and args.max_np is not None:
        if args.max_np < args.np:
            raise ValueError(f"--max-np {args.max_np} is less than -np {args.np}")
        if args.max_np != args.np and not discovery:
            raise ValueError(f"--max-np {args.max_np} differs from -np {args.np}: a job grows "
                             "only onto hosts a --host-discovery-script lists; give one, or "
                             "give -np the size to start with")
    if discovery and (args.hosts is not None or args.hostfile is not None):
        raise ValueError("--host-discovery-script and -H/--hostfile both say where to run: "
                         "give one (the script may print a fixed list)")
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None:
        if not discovery:
            raise ValueError("--blacklist-cooldown-range applies to the hosts of a "
                             "--host-discovery-script; give one")
        if cooldown[0] > cooldown[1]:
            raise ValueError(f"--blacklist-cooldown-range {cooldown[0]} {cooldown[1]}: the "
                             "lower bound is above the upper one")


def user_env(items: Sequence[str],
             environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
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
