"""Which deterministic design runs a floating-point reduction (``MPITRAIN_DETERMINISTIC``).

With the mode off nothing here runs.  With it on, :mod:`.algorithms` hands every elementwise
floating-point reduction (Sum, Average as a Sum with a postscale, Min, Max, Product) here
instead of to its table, and the result depends only on each rank's input and the rank
order, whatever the fusion (elements are reduced one by one, so where a tensor lies in a
bucket does not matter), the algorithm asked for (autotune's included), the channels, the node
layout and the timing:

* ``rank-order`` (:mod:`.ordered`): folded in rank order; the requested algorithm is not
  used, the channels are;
* ``fixed-point`` (:mod:`.fixed_point`): Sums as integers, through whichever algorithm the
  table picks for those integers (all are exact on them), so also independent of the rank
  order and the world size; Min, Max and Product folded in rank order as above (Min and Max
  of numbers do not depend on the order at all; NaN and the sign of a zero would, in MPI's
  own; a Product's rounding does).

Every rank computes the same route from the same inputs (the agreed configuration, the size,
the agreed topology), so the collectives match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.dtypes import FLOATING, ReduceOp
from . import channels, fixed_point, ordered
from .group import Group
from .kernels import cpu
from .reduction import ELEMENTWISE, Overrides, Reduction, check_floating
from .scratch import Scratch
from .shm import Node

# The exact collectives the fixed-point design runs on: (group, send, recv, how, ...) -> None,
# i.e. mpitrain.ops.algorithms.allreduce and reducescatter, for integers.
IntegerAllreduce = Callable[..., None]
IntegerReducescatter = Callable[..., None]


@dataclass(frozen=True)
class Route:
    """Where a deterministic sum's own collectives go: the group and the per-call overrides
    (autotune's algorithm and channels), and the data plane's integer collectives."""

    group: Group
    overrides: Overrides
    allreduce: IntegerAllreduce
    reducescatter: IntegerReducescatter


@dataclass
class _Integers:
    """:class:`fixed_point.IntegerCollectives` over the group's own algorithms."""

    route: Route
    scratch: Scratch

    def allreduce(self, buf: np.ndarray, dtype: str, op: ReduceOp) -> None:
        r = self.route
        r.allreduce(r.group, buf, buf, Reduction(dtype, op=op), overrides=r.overrides)

    def reducescatter(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                      dtype: str, op: ReduceOp) -> None:
        self.route.reducescatter(self.route.group, send, recv, counts, Reduction(dtype, op=op))


def applies(group: Group, how: Reduction) -> bool:
    """Whether this reduction takes a deterministic route (the same answer on every rank)."""
    return (bool(group.config.deterministic) and how.dtype in FLOATING
            and how.op in ELEMENTWISE)


def _fixed(group: Group, how: Reduction) -> bool:
    return group.config.deterministic == "fixed-point" and how.op == ReduceOp.SUM


def _node(group: Group) -> Node | None:
    """The node state when every rank of the group is on this node (collective once)."""
    if group.topology.num_nodes != 1 or group.size == 1:
        return None
    return group.node()


def _ranks(group: Group) -> ordered.Ranks:
    return ordered.Ranks(group.comm, _node(group), group.workspace("ordered"))


def allreduce(route: Route, send: np.ndarray, recv: np.ndarray, how: Reduction) -> None:
    """The deterministic reduction of ``send`` over the route's group into ``recv``.

    Raises:
        TypeError, ValueError: ``how`` is not an elementwise floating-point reduction.
    """
    check_floating(how)
    group = route.group
    if _fixed(group, how):
        fixed_point.check_world(group.size)
        fixed_point.allreduce(send, recv, how, _Integers(route, group.workspace("fixed")))
        return

    def prepare(g: Group) -> None:
        _node(g)  # collective set-up, in channel order on every rank
        cpu.warm_up([how.dtype])

    def run(g: Group, send_part: np.ndarray, recv_part: np.ndarray) -> None:
        ordered.allreduce(_ranks(g), send_part, recv_part, how)

    channels.run(group, send, recv, route.overrides.streams or group.config.allreduce_streams,
                 run, prepare)


def reducescatter(route: Route, send: np.ndarray, recv: np.ndarray, counts: Sequence[int],
                  how: Reduction) -> None:
    """Rank i keeps the deterministic reduction of block i (``counts[i]`` elements)."""
    check_floating(how)
    group = route.group
    if _fixed(group, how):
        fixed_point.check_world(group.size)
        fixed_point.reducescatter(send, recv, counts, group.rank, how,
                                  _Integers(route, group.workspace("fixed")))
        return
    ordered.reducescatter(_ranks(group), send, recv, counts, how)
