"""Where Adasum can run: a power of two of ranks (flat), or of equal nodes (hierarchical).

A question about the job's layout, asked by the front door at the call (so a caller's mistake
is a clear error on every rank before anything is submitted) and by the data plane before it
runs; it lives on the ground floor so that both can ask it without importing each other.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdasumLayoutError", "check_layout"]


class AdasumLayoutError(ValueError, NotImplementedError):
    """The ranks cannot run Adasum: not a power of two of them (or of nodes, hierarchical).

    A ``ValueError`` like mpitrain's other caller mistakes, and a ``NotImplementedError`` as
    Horovod raises for the same calls, so either ``except`` clause catches it.
    """


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_layout(topology: Any, hierarchical: bool) -> None:
    """Raise unless Adasum can run on ``topology`` (a :class:`mpitrain.core.topology.Topology`).

    Raises:
        AdasumLayoutError: flat, the number of ranks is not a power of two; hierarchical,
            the nodes differ in size or their number is not a power of two.
    """
    if not hierarchical:
        if not _power_of_two(topology.size):
            raise AdasumLayoutError(
                f"op=Adasum needs a power-of-two number of ranks; this process set has "
                f"{topology.size} (Horovod raises NotImplementedError here too)")
        return
    if not topology.is_homogeneous:
        raise AdasumLayoutError(
            f"hierarchical Adasum (MPITRAIN_ADASUM_HIERARCHICAL=1) needs the same number of "
            f"ranks on every node; the node sizes are {list(topology.node_sizes)}")
    if not _power_of_two(topology.num_nodes):
        raise AdasumLayoutError(
            f"hierarchical Adasum (MPITRAIN_ADASUM_HIERARCHICAL=1) needs a power-of-two "
            f"number of nodes; there are {topology.num_nodes} (of {topology.local_size} "
            f"ranks each)")
