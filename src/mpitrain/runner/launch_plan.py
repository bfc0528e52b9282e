"""The plan of one launch: the command ``mpitrainrun`` runs, decided from its options, the
environment, the hosts and the MPI library; pure apart from reading a hostfile.

Separate from :mod:`.launch` (the entry point: it finds the launcher, then runs the plan once,
restarting, under the elastic driver, or through the rendezvous agents) because every launch is
planned here the same way, and the tests check plans without starting anything.  The hosts
come from ``-H``, ``--hostfile`` or the scheduler's allocation (Slurm's ``srun`` where it
applies); without any, every rank runs on this machine.  Elastic options add ULFM's flags where
the survivors can go on in place, otherwise a restart plan: the state file rank 0 commits to,
and with host discovery the directory through which the driver and the job talk.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .. import horovod_compat
from . import allocation, horovodrun_flags
from .hosts import HostSlots, parse_hosts_string, place, read_hostfile, with_slots
from .interpreter import ranks_command
from .launch_options import check_elastic, elastic_requested, settings_from_args, user_env
from .mpi_command import (
    SRUN_MPI_PLUGINS,
    Flavor,
    LaunchSpec,
    build_command,
    build_srun,
    forwarded_names,
)

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
    control_dir: str | None = None  # --host-discovery-script: see mpitrain.core.elastic_control
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


def _srun_mpi_plugin(flavor: Flavor | None, environ: Mapping[str, str],
                     mpi_args: Sequence[str]) -> str | None:
    """srun's ``--mpi=`` for the library, unless the user chose one (SLURM_MPI_TYPE, --mpi)."""
    chosen = "SLURM_MPI_TYPE" in environ or any(a == "--mpi" or a.startswith("--mpi=")
                                                for a in mpi_args)
    return None if chosen or flavor is None else SRUN_MPI_PLUGINS.get(flavor)


__all__ = ["DEFAULT_RESTARTS", "FAILURE_DETECTOR", "Plan", "make_plan"]
