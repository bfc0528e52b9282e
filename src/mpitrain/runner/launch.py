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
MPITRAIN_* settings they become, are in :mod:`.launch_options`.
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
from dataclasses import dataclass
from typing import NamedTuple

from .. import horovod_compat
from . import allocation, build_info, horovodrun_flags, rdzv_launch
from .discovery import Blacklist, DiscoveryError, DiscoveryScript
from .discovery import place as place_on_hosts
from .elastic_driver import DriverOptions, ElasticDriver, forwarding_signals, layout_string
from .hosts import HostfileError, HostSlots, parse_hosts_string, place, read_hostfile, with_slots
from .interpreter import missing_script, python_note, ranks_command
from .launch_options import (
    build_parser,
    check_elastic,
    elastic_requested,
    settings_from_args,
    user_env,
)
from .launcher_report import LauncherWatch, lost_daemon_message
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
from .rdzv_options import RendezvousOptions, rendezvous_options
from .rdzv_wire import SECRET_VARIABLE

_OVERSUBSCRIBE_FLAGS = ("--oversubscribe", "-oversubscribe")


@dataclass
class Plan:
    """What mpitrainrun decided: the argv and a description for --verbose; in elastic restart
    mode, how often to restart and the state file the job's rank 0 writes its commits to."""

    argv: list[str]
    placement: str
    hosts_to_resolve: list[str]
    restarts: int | None = None
    state_file: str | None = None
    keep_state_file: bool = False
    control_dir: str | None = None  # with --host-discovery-script: see mpitrain.elastic_control
    in_place: bool = False  # survivors continue in place (ULFM)
    local_only: bool = False  # every rank runs on this machine (its files are the ranks')


class _Restart(NamedTuple):
    restarts: int
    state_file: str
    keep_state_file: bool
    control_dir: str | None
    in_place: bool


DEFAULT_RESTARTS = 3
# Open MPI 5.0's runtime tells ULFM survivors when a rank is killed by a signal or exits with
# status 0 without MPI_Finalize, but not when it exits with another status (os._exit(3), a C
# library's exit(1)): they waited forever (2026-11-27, Open MPI 5.0.11 from PyPI).  ULFM's
# heartbeat detector finds that rank too.  Heartbeats flow while a rank calls into MPI, which
# mpitrain's engine thread does unless the GIL is held; a rank holding it longer than the
# timeout is taken for dead (Open MPI's default 10 s failed a healthy rank whose C call held
# the GIL for 15 s), so the timeout is a minute: a hang becomes a lost rank after 60 s.
FAILURE_DETECTOR = (("mpi_ft_detector", "true"), ("mpi_ft_detector_timeout", "60"))


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
    restart: _Restart | None = None
    elastic = elastic_requested(args)
    in_place = discovery = False
    if elastic:
        if not getattr(args, "placed_by_driver", False):
            check_elastic(args)
        through_mpirun = srun is None or args.launcher == "mpirun"
        in_place = flavor == Flavor.OPENMPI and not args.elastic_restart and through_mpirun
        discovery = args.host_discovery_script is not None
        if in_place and "--with-ft" not in mpi_args:
            mpi_args = ["--with-ft", "ulfm", *mpi_args]
        if in_place:
            for name, value in FAILURE_DETECTOR:
                if name not in mpi_args:  # the user's own setting wins
                    mpi_args += ["--mca", name, value]
        if not in_place or discovery:
            # No ULFM (or asked not to use it): restart the job from rank 0's last commit;
            # with discovery, also to grow it onto new hosts.
            state_file = os.path.abspath(args.elastic_state_file or
                                         f".mpitrain-elastic-{os.getpid()}.pkl")
            limit = DEFAULT_RESTARTS if args.reset_limit is None else args.reset_limit
            restart = _Restart(limit, state_file, args.elastic_state_file is not None,
                               state_file + ".control" if discovery else None, in_place)
    oversubscribe = any(a in _OVERSUBSCRIBE_FLAGS for a in mpi_args)
    settings, extra_names = user_env(args.env, environ)
    settings = {**settings_from_args(args), **settings}
    if restart is not None:
        if not in_place:
            # The launcher counts restarts, and a restarted job always has all its ranks.
            settings.pop("MPITRAIN_ELASTIC_RESET_LIMIT", None)
            settings.pop("MPITRAIN_ELASTIC_MIN_NP", None)
        settings["MPITRAIN_ELASTIC_STATE_FILE"] = restart.state_file
        if restart.control_dir is not None:
            settings["MPITRAIN_ELASTIC_CONTROL_DIR"] = restart.control_dir
            if in_place:  # the file is needed only when the job stops to grow
                settings["MPITRAIN_ELASTIC_COMMIT_TO_FILE"] = "0"
    hosts, alloc = _host_source(args, environ)
    if hosts is not None and args.npernode is not None:
        hosts = with_slots(hosts, args.npernode)

    if args.horovod_compat:
        settings["PYTHONPATH"] = horovod_compat.with_shim_first(
            settings.get("PYTHONPATH", environ.get("PYTHONPATH")))
    spec = LaunchSpec(np=args.np, command=ranks_command(args.command), npernode=args.npernode,
                      settings=settings, network_interface=args.network_interface,
                      mpi_args=mpi_args, as_root=as_root, binding=horovodrun_flags.binding(args))
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
        spec.launcher_args = horovodrun_flags.launcher_args(args, flavor, False)
        placement = f"{args.np} process(es) on this machine ({cores} cores)"
        if flavor is None or launcher is None:
            raise ValueError("no MPI launcher")
        return _with_restart(Plan(build_command(flavor, launcher, spec), placement, [],
                                  local_only=True), restart)

    placed = list(hosts) if oversubscribe else place(args.np, hosts)
    # Ranks beyond this machine's cores (e.g. -H localhost:16): ask MPI not to busy-poll.
    spec.yield_when_idle = any(_is_this_machine(h.host) and h.slots > cores for h in placed)
    placement = ", ".join(f"{h.host}:{h.slots}" for h in placed)
    if alloc is not None:
        placement = f"{alloc.scheduler} allocation: {placement}"
    spec.launcher_args = horovodrun_flags.launcher_args(args, flavor, use_srun)
    if use_srun:
        spec.srun_mpi = _srun_mpi_plugin(flavor, environ, mpi_args)
        return _with_restart(Plan(build_srun(spec, srun or "srun"), placement, []), restart)
    if alloc is not None and alloc.scheduler == "slurm":
        # mpirun reads the Slurm allocation itself; only the count is ours to give.
        spec.hosts = None
    else:
        spec.hosts = placed
    if flavor is None or launcher is None:
        raise ValueError("no MPI launcher")
    to_resolve = [h.host for h in placed] if alloc is None else []
    local_only = alloc is None and all(_is_this_machine(h.host) for h in placed)
    return _with_restart(Plan(build_command(flavor, launcher, spec), placement, to_resolve,
                              local_only=local_only), restart)


def _with_restart(plan: Plan, restart: _Restart | None) -> Plan:
    if restart is not None:
        plan.restarts, plan.state_file, plan.keep_state_file = restart[:3]
        plan.control_dir, plan.in_place = restart.control_dir, restart.in_place
    return plan


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
    """Run the launcher, passing SIGINT/SIGTERM on to it, and return its exit code (1 when
    Open MPI ended the job over a lost node and still exited 0, see .launcher_report)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watch = LauncherWatch(proc)
    with forwarding_signals(proc):
        code = proc.wait()
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
