"""The nodes of a rendezvous: what each agent says about itself, who may join, and the order
that becomes node ranks (and so MPI ranks: node r holds the r-th block of consecutive ranks)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Node:
    """One agent of the rendezvous.

    ``addr`` is the address the agent's machine used to reach the endpoint: the one the MPI
    launcher is given for it (a name would need DNS to agree on every node, which Kubernetes
    pods and many batch systems do not promise).  ``host`` is its host name, for messages.
    """

    host: str
    addr: str
    nproc: int
    wanted_rank: int | None = None
    serving: bool = False

    def hello(self) -> dict[str, Any]:
        return {"host": self.host, "addr": self.addr, "nproc": self.nproc,
                "node_rank": self.wanted_rank, "serving": self.serving}

    @classmethod
    def from_hello(cls, hello: Mapping[str, Any]) -> Node:
        """The node an agent's hello describes.

        Raises:
            ValueError: a field is missing or of the wrong type (not our agent).
        """
        try:
            host, addr, nproc = hello["host"], hello["addr"], hello["nproc"]
            rank, serving = hello.get("node_rank"), hello.get("serving", False)
        except KeyError as exc:
            raise ValueError(f"hello without {exc.args[0]!r}") from None
        if not (isinstance(host, str) and isinstance(addr, str) and isinstance(nproc, int)
                and nproc >= 1 and (rank is None or isinstance(rank, int))
                and isinstance(serving, bool)):
            raise ValueError(f"malformed hello: {dict(hello)!r:.200}")
        return cls(host, addr, nproc, rank, serving)


def describe(node: Node, rank: int | None = None) -> str:
    """``node 2 (trn-3, 10.0.0.3)``, or ``node trn-3 (10.0.0.3)`` before ranks are known."""
    if rank is None:
        return f"node {node.host} ({node.addr})"
    return f"node {rank} ({node.host}, {node.addr})"


def why_not_join(joined: Sequence[Node], new: Node, nnodes: int) -> str | None:
    """Why ``new`` may not join the nodes already there, or None when it may."""
    if ":" in new.addr:
        return (f"{describe(new)}: an IPv6 address, which the MPI launchers' host lists "
                "(host:slots) cannot carry; reach the endpoint over IPv4, or give --local-addr "
                "an IPv4 address")
    if new.wanted_rank is not None and not 0 <= new.wanted_rank < nnodes:
        return (f"{describe(new)} asks for --node-rank {new.wanted_rank}, outside 0..{nnodes - 1} "
                f"of --nnodes {nnodes}")
    for node in joined:
        if node.addr == new.addr:
            return (f"{describe(new)}: an agent from the same address already joined "
                    f"({describe(node)}); start one mpitrainrun per node")
        if new.wanted_rank is not None and node.wanted_rank == new.wanted_rank:
            return (f"{describe(new)} asks for --node-rank {new.wanted_rank}, which "
                    f"{describe(node)} already has")
    if len(joined) >= nnodes:
        return f"{describe(new)}: all {nnodes} nodes of --nnodes {nnodes} have joined already"
    return None


def assign(nodes: Sequence[Node]) -> list[Node]:
    """The nodes in node-rank order.

    A node that gave ``--node-rank`` gets it; the others fill the free ranks, the serving
    node first (so that without any ``--node-rank`` rank 0 runs on the endpoint's host, where
    users look for it), then by host name and address, so that the same machines get the same
    ranks in every run, whatever order they arrived in.

    Raises:
        ValueError: two nodes want the same rank, or a wanted rank is out of range (the server
            refuses those at join; this is the last line of defence).
    """
    count = len(nodes)
    ranked: list[Node | None] = [None] * count
    for node in nodes:
        if node.wanted_rank is not None:
            if not 0 <= node.wanted_rank < count or ranked[node.wanted_rank] is not None:
                raise ValueError(f"--node-rank {node.wanted_rank} of {describe(node)} is out of "
                                 f"range or taken")
            ranked[node.wanted_rank] = node
    rest = sorted((n for n in nodes if n.wanted_rank is None),
                  key=lambda n: (not n.serving, n.host, n.addr))
    free = iter(i for i, slot in enumerate(ranked) if slot is None)
    for node in rest:
        ranked[next(free)] = node
    return [n for n in ranked if n is not None]


__all__ = ["Node", "assign", "describe", "why_not_join"]
