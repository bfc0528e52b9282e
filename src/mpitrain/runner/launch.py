"""``mpitrainrun``: start an mpitrain job with the right MPI command, the way horovodrun does.

Examples::

    mpitrainrun -np 4 python train.py                         # this machine
    mpitrainrun -np 8 -H node1:4,node2:4 python train.py      # two hosts over ssh
    mpitrainrun -np 16 --hostfile hosts -npernode 8 python train.py
    mpitrainrun -np 8 --dry-run python train.py               # print the command only
    mpitrainrun --check-build                                 # what this install supports

Where the hosts come from, in order: ``-H``, ``--hostfile``, the scheduler allocation this
command runs inside (Slurm: ``srun`` is used, no hostfile; PBS and LSF: their node files), and
otherwise this machine alone, whose slots are its cores.  The options themselves, and the
MPITRAIN_* settings they become, are in :mod:`.launch_options`; the command each launch runs is
planned by :mod:`.launch_plan`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from .. import horovod_compat
from . import allocation, build_info, horovodrun_flags, rdzv_launch
from .discovery import Blacklist, DiscoveryError, DiscoveryScript
from .discovery import place as place_on_hosts
from .elastic_driver import DriverOptions, ElasticDriver, layout_string
from .hosts import HostfileError, HostSlots
from .interpreter import missing_script, python_note
from .launch_options import build_parser, check_elastic, elastic_requested
from .launch_plan import Plan, make_plan
from .launcher_report import LauncherWatch, lost_daemon_message, wait_bounded
from .mpi_command import Flavor, detect_flavor, find_launcher
from .rdzv_options import RendezvousOptions, rendezvous_options
from .rdzv_wire import SECRET_VARIABLE
from .signals import forwarding_signals


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_restarting(plan: Plan) -> int:
    """Elastic restart mode: run the job; while it fails and restarts remain, run it again
    (its rank 0 resumes from the state file).  The file goes when the job succeeds, unless
    the user named it."""
    assert plan.restarts is not None and plan.state_file is not None
    attempt = 0
    while True:
        code = _run(plan.argv)
        if code == 0:
            if not plan.keep_state_file and os.path.exists(plan.state_file):
                os.unlink(plan.state_file)
            return 0
        if attempt >= plan.restarts:
            print(f"mpitrainrun: the job failed (exit {code}) and was restarted {attempt} "
                  f"time(s), the --reset-limit; giving up (its last commit is in "
                  f"{plan.state_file})", file=sys.stderr)
            return code
        attempt += 1
        resume = ("from its last commit" if os.path.exists(plan.state_file)
                  else "from the start (no commit was written)")
        print(f"mpitrainrun: the job failed (exit {code}); restarting it {resume} "
              f"({attempt} of {plan.restarts})", file=sys.stderr, flush=True)


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
    """Run the launcher, passing SIGINT/SIGTERM on to it, and return its exit code (1 when
    Open MPI ended the job over a lost node and still exited 0, or said it was ending the job
    and did not exit; see .launcher_report)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watch = LauncherWatch(proc)
    with forwarding_signals(proc):
        code = wait_bounded(proc, watch, "mpitrainrun")
    watch.join(5.0)
    if code == 0 and watch.daemon_lost:
        print(lost_daemon_message("mpitrainrun", watch.lost_node), file=sys.stderr)
        return 1
    return code


def run_elastic(args: argparse.Namespace, plan_for: Callable[[list[HostSlots]], Plan],
                first: Plan) -> int:
    """``--host-discovery-script``: the elastic driver (:mod:`.elastic_driver`) runs the job,
    each launch planned by ``plan_for(layout)``; ``first`` is a plan for its files."""
    assert first.state_file is not None and first.control_dir is not None
    script = DiscoveryScript(args.host_discovery_script, args.slots)
    cooldown = args.blacklist_cooldown_range
    options = DriverOptions(
        np=args.np, min_np=args.min_np or 1, max_np=args.max_np or args.np,
        restarts=first.restarts or 0, elastic_timeout_s=args.elastic_timeout,
        interval_s=args.discovery_interval, control_dir=first.control_dir,
        state_file=first.state_file, keep_state_file=first.keep_state_file)

    def command_for(layout: list[HostSlots]) -> list[str]:
        plan = plan_for(layout)
        check_hosts_resolve(plan.hosts_to_resolve)
        if args.verbose:
            print(f"mpitrainrun: {shlex.join(plan.argv)}", file=sys.stderr)
        return plan.argv

    driver = ElasticDriver(options, script.find,
                           Blacklist((float(cooldown[0]), float(cooldown[1]))
                                     if cooldown else None),
                           command_for)
    return driver.run()


def _default_launcher(mpi: str, environ: Mapping[str, str]) -> str:
    try:
        return find_launcher(environ)
    except FileNotFoundError:
        if mpi == "auto":
            raise
        # The flavor was named: its conventional launcher name serves --dry-run anywhere.
        return "mpirun" if mpi == "openmpi" else "mpiexec"


def _rendezvous(args: argparse.Namespace, opts: RendezvousOptions,
                env: Mapping[str, str]) -> int:
    """``--rdzv-endpoint``: this process is one node's agent (:mod:`.rdzv_launch`); the agent
    that serves the rendezvous runs the launcher planned here, as any other launch."""
    command = list(args.command)
    if command and command[0].endswith(".py"):
        command.insert(0, sys.executable)  # torchrun's habit: a script runs under this Python
    job_env = {k: v for k, v in env.items() if k != SECRET_VARIABLE}  # never forwarded
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    try:
        launcher = args.mpirun or _default_launcher(args.mpi, env)
        flavor = Flavor(args.mpi) if args.mpi != "auto" else detect_flavor(launcher)
        if elastic_requested(args) and flavor is not Flavor.OPENMPI:
            raise ValueError(f"elastic options with --rdzv-endpoint need Open MPI (ULFM lets "
                             f"the survivors go on); with {flavor.value} a lost rank ends the "
                             "job, and the scheduler's restart of the tasks starts it again")

        def plan(hosts: str, np: int, ssh: str) -> Plan:
            placed = argparse.Namespace(**vars(args))
            placed.hosts, placed.np, placed.command, placed.launcher = hosts, np, command, \
                "mpirun"
            placed.mpi_args = shlex.join(rdzv_launch.launcher_args(flavor, ssh)) + " " + \
                args.mpi_args
            return make_plan(placed, job_env, flavor, launcher, _cores(), as_root)

        # Planned now, on stand-in node names, so that a bad option fails before any waiting
        # (and so that --dry-run shows the command).
        first = plan(rdzv_launch.host_list([(f"NODE{i}", opts.nproc)
                                            for i in range(opts.nnodes)]),
                     opts.nnodes * opts.nproc, "RDZV_SSH")
    except (ValueError, FileNotFoundError) as exc:
        print(f"mpitrainrun: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(shlex.join(first.argv))
        return 0
    # Elastic options with Open MPI run ULFM (make_plan added --with-ft ulfm): survivors of a
    # lost node go on, so the agents must not end the job for it.  (Restart mode and host
    # discovery were refused with the rendezvous.)
    in_place = elastic_requested(args) and flavor is Flavor.OPENMPI
    return rdzv_launch.run(opts, env, flavor, lambda h, n, s: plan(h, n, s).argv,
                           elastic=in_place, verbose=args.verbose)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Entry point of ``mpitrainrun``; returns the job's exit code (2 for usage errors)."""
    parser = build_parser()
    args = parser.parse_args(horovodrun_flags.normalize_argv(
        sys.argv[1:] if argv is None else argv))
    env = os.environ if environ is None else environ
    if args.config_file:
        try:
            config_notes = horovodrun_flags.apply_config_file(args, parser)
        except ValueError as exc:
            print(f"mpitrainrun: error: {exc}", file=sys.stderr)
            return 2
    else:
        config_notes = []
    for note in [*horovodrun_flags.notes(args), *config_notes]:
        print(f"mpitrainrun: {note}", file=sys.stderr)
    if args.check_build:
        print(build_info.render(build_info.collect()))
        return 0
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    try:
        rendezvous = rendezvous_options(args)
    except ValueError as exc:
        print(f"mpitrainrun: error: {exc}", file=sys.stderr)
        return 2
    if rendezvous is not None:
        return _rendezvous(args, rendezvous, env)
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

        def plan_for(layout: list[HostSlots]) -> Plan:
            # One launch of the elastic driver: its hosts are placed (checked once, below).
            placed = argparse.Namespace(**vars(args), placed_by_driver=True)
            placed.hosts, placed.np = layout_string(layout), sum(h.slots for h in layout)
            return make_plan(placed, env, flavor, launcher, _cores(), as_root, srun)

        if args.host_discovery_script is not None:
            check_elastic(args)
            # Plan once on the hosts the script lists now: checks the options, names the
            # files, and is what --dry-run prints.
            first_hosts = DiscoveryScript(args.host_discovery_script, args.slots).find()
            if not first_hosts:
                raise ValueError(f"host discovery {args.host_discovery_script!r} lists no "
                                 "hosts")
            plan = plan_for(place_on_hosts(first_hosts, list(first_hosts), args.np))
        else:
            plan = make_plan(args, env, flavor, launcher, _cores(), as_root, srun)
        if not args.dry_run:
            check_hosts_resolve(plan.hosts_to_resolve)
            missing = missing_script(args.command, os.getcwd()) if plan.local_only else None
            if missing is not None:
                raise FileNotFoundError(missing)
    except (ValueError, FileNotFoundError, DiscoveryError) as exc:
        kind = "hostfile" if isinstance(exc, HostfileError) else "error"
        print(f"mpitrainrun: {kind}: {exc}", file=sys.stderr)
        return 2
    if args.horovod_compat and (real := horovod_compat.real_horovod()) is not None:
        print(horovod_compat.shadowing_note(real), file=sys.stderr)
    interpreter = python_note(args.command, env)
    if interpreter is not None and not args.dry_run:
        print(interpreter, file=sys.stderr)
    if args.dry_run:
        print(shlex.join(plan.argv))
        return 0
    if args.verbose:
        print(f"mpitrainrun: {plan.placement}", file=sys.stderr)
        print(f"mpitrainrun: {shlex.join(plan.argv)}", file=sys.stderr)
    if args.host_discovery_script is not None:
        return run_elastic(args, plan_for, plan)
    if plan.restarts is not None:
        return run_restarting(plan)
    return _run(plan.argv)


if __name__ == "__main__":
    sys.exit(main())
