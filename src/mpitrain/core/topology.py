"""Which ranks share a node: local and cross communicators, and the node layout.

The launcher's environment tells each process its local rank (``OMPI_COMM_WORLD_LOCAL_RANK``
and friends); MPI's shared-memory split tells which processes really share a node.  We group by
MPI's split and order each group by the launcher's local rank, so that device binding follows
the launcher; where the launcher's numbers do not form a valid 0..n-1 numbering of MPI's groups,
MPI wins and we warn once.

``MPITRAIN_LOCAL_SIZE=k`` cuts each real node into emulated nodes of k consecutive local ranks
(the last one smaller when k does not divide the node), so hierarchical and local-scope code
runs on one machine exactly as it would across several.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import survivors

# Launchers' names for "my index among the processes of this node", in order of preference.
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
    "MPI_LOCALRANKID",  # MPICH Hydra, Intel MPI
    "MV2_COMM_WORLD_LOCAL_RANK",  # MVAPICH2
    "PMI_LOCAL_RANK",  # PMI-2 launchers
    "PALS_LOCAL_RANKID",  # HPE Cray PALS
    "SLURM_LOCALID",  # srun
)

_warned_disagreement = False


def env_local_rank(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Return (variable, value) of the first launcher local-rank variable set, if any."""
    env = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        raw = env.get(name)
        if raw is None:
            continue
        try:
            return name, int(raw)
        except ValueError:
            warnings.warn(f"mpitrain: ignoring {name}={raw!r}: not an integer", RuntimeWarning,
                          stacklevel=2)
    return None


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: ranks are indices in the job's communicator, not host names."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_index: int
    node_sizes: tuple[int, ...]  # ranks per (possibly emulated) node, in node order
    layout: tuple[tuple[int, int], ...]  # layout[r] = (node_index, local_rank) of rank r
    machine_local_size: int  # processes really sharing this machine (for thread shares)
    emulated: bool
    hostname: str

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.node_sizes)) == 1

    def node_ranks(self, node: int) -> list[int]:
        """Ranks of ``node`` in local-rank order."""
        members = [(lr, r) for r, (n, lr) in enumerate(self.layout) if n == node]
        return [r for _, r in sorted(members)]


@dataclass
class Communicators:
    """The communicators derived from the job's communicator; freed by :meth:`free`."""

    world: Any
    local: Any
    cross: Any
    machine: Any  # the real shared-memory group, emulation ignored
    freed: bool = False

    def free(self) -> None:
        """Free every communicator (once; later calls do nothing)."""
        if self.freed:
            return
        self.freed = True
        for comm in (self.local, self.cross, self.machine, self.world):
            survivors.release(comm)


def _warn_once(message: str) -> None:
    global _warned_disagreement
    if not _warned_disagreement:
        _warned_disagreement = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def build(comm: Any, emulated_local_size: int = 0, use_launcher_env: bool = True,
          environ: Mapping[str, str] | None = None) -> tuple[Topology, Communicators]:
    """Split ``comm`` into node-local and cross-node communicators.

    Every rank of ``comm`` must call this, in the same order (it is collective).

    Args:
        comm: the job's communicator (already duplicated by the caller).
        emulated_local_size: k > 0 cuts each machine into nodes of k consecutive local ranks.
        use_launcher_env: order node groups by the launcher's local rank variables (only
            meaningful when ``comm`` spans MPI_COMM_WORLD).
        environ: environment to read the launcher's variables from.

    Returns:
        The Topology of this rank and the communicators it was derived from.
    """
    from mpi4py import MPI  # importing it starts MPI: only once init() runs

    rank = comm.Get_rank()
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)

    found = env_local_rank(environ) if use_launcher_env else None
    env_value = found[1] if found is not None else -1
    peers = machine.allgather(env_value)
    valid_here = found is not None and sorted(peers) == list(range(machine.Get_size()))
    # All ranks must take the same branch: agree on the worst case across the job.
    valid_everywhere = comm.allreduce(1 if valid_here else 0, op=MPI.MIN) == 1
    if valid_everywhere and found is not None:
        ordered = machine.Split(0, key=env_value)
        machine.Free()
        machine = ordered
    elif found is not None and not valid_here:
        _warn_once(f"mpitrain: launcher says {found[0]}={found[1]} but MPI's shared-memory "
                   f"split puts {machine.Get_size()} ranks on this node with local ranks "
                   f"{peers}; trusting MPI (local rank {machine.Get_rank()}).")

    if emulated_local_size > 0:
        # Emulated nodes are blocks of k consecutive ranks of the job, whatever order the
        # launcher numbered them in on this machine.
        position = sorted(machine.allgather(rank)).index(rank)
        local = machine.Split(position // emulated_local_size, key=rank)
    else:
        local = machine.Dup()
    return _assemble(comm, local, machine, emulated=emulated_local_size > 0)


def build_subset(comm: Any, world: Topology, world_ranks: list[int]) -> tuple[Topology,
                                                                            Communicators]:
    """Topology of a process set: its members keep the nodes they have in the whole job.

    Collective over the members of ``comm`` (the set's communicator, ranks ordered as
    ``world_ranks``).
    """
    from mpi4py import MPI  # importing it starts MPI: only once init() runs

    node, local_rank = world.layout[world.rank]
    local = comm.Split(node, key=local_rank)
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    return _assemble(comm, local, machine, emulated=world.emulated)


def _assemble(comm: Any, local: Any, machine: Any, emulated: bool) -> tuple[Topology,
                                                                           Communicators]:
    """Derive node numbering, layout and the cross communicator from a local split."""
    from mpi4py import MPI  # importing it starts MPI: only once init() runs

    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank, local_size = local.Get_rank(), local.Get_size()

    # Number nodes by their lowest rank so every rank agrees on the order.
    leader = local.allreduce(rank, op=MPI.MIN)
    leaders = sorted(set(comm.allgather(leader)))
    node_index = leaders.index(leader)
    layout = tuple(tuple(x) for x in comm.allgather((node_index, local_rank)))
    node_sizes = [0] * len(leaders)
    for n, _ in layout:
        node_sizes[n] += 1

    cross = comm.Split(local_rank, key=node_index)
    topo = Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross.Get_rank(),
        cross_size=cross.Get_size(),
        node_index=node_index,
        node_sizes=tuple(node_sizes),
        layout=layout,
        machine_local_size=machine.Get_size(),
        emulated=emulated,
        hostname=MPI.Get_processor_name(),
    )
    return topo, Communicators(world=comm, local=local, cross=cross, machine=machine)
