"""Launching jobs: the ``mpitrainrun`` launcher and the host-list parser it shares with
``mpitrain-hostfile`` (hostfiles, ``-H`` strings, Slurm/PBS/LSF allocations)."""

from .allocation import Allocation, detect, expand_counts, expand_nodelist, slurm_hosts
from .hosts import (
    FORMATS,
    HostfileError,
    HostSlots,
    format_hosts,
    parse_hostfile_text,
    parse_hosts_string,
    place,
    read_hostfile,
)
from .mpi_command import Flavor, LaunchSpec, build_command, build_srun

__all__ = [
    "FORMATS",
    "Allocation",
    "Flavor",
    "HostSlots",
    "HostfileError",
    "LaunchSpec",
    "build_command",
    "build_srun",
    "detect",
    "expand_counts",
    "expand_nodelist",
    "format_hosts",
    "parse_hostfile_text",
    "parse_hosts_string",
    "place",
    "read_hostfile",
    "slurm_hosts",
]
