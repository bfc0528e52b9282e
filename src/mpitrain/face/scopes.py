"""Communication scopes: "global" (every rank) or "local" (the ranks of this node) as a ProcessSet.

AIACC-Training let SyncBatchNorm synchronise over all ranks or only within a node; here a scope
is resolved to a process set so that every layer above uses the engine's ordinary collectives.

The local scope needs one registered process set per node.  Process sets are registered by
every rank in the same order, so :func:`local_process_set` registers *all* nodes' sets (node
0 first), on every rank, the first time any rank asks; the result is cached for the life of
this ``init()`` and follows the node layout of the topology (including ``MPITRAIN_LOCAL_SIZE``
emulation).  The first call is therefore collective: every rank must reach it at the same point
of its program, which holds when it happens inside a collective layer such as SyncBatchNorm's
forward pass.
"""

from __future__ import annotations

import threading
from typing import Any

from ..core import runtime
from ..core.process_sets import ProcessSet, global_process_set
from ..session import add_process_set

GLOBAL = "global"
LOCAL = "local"

_lock = threading.Lock()
# (the runtime State the sets were registered under, this rank's node set)
_cached: tuple[Any, ProcessSet] | None = None


def local_process_set() -> ProcessSet:
    """Return the process set of this rank's node, registering every node's set on first use.

    Collective on first use: every rank must call it, at the same point, in the same order
    relative to other process-set registrations.  With a single node the global process set is
    returned and nothing is registered.

    Raises:
        ValueError: mpitrain is not initialised.
    """
    global _cached
    state = runtime.state()
    topo = state.topology
    if topo.num_nodes == 1:
        return global_process_set
    with _lock:
        if _cached is not None and _cached[0] is state and _cached[1].process_set_id is not None:
            return _cached[1]
        # Every rank registers the same list in the same (node) order: process-set ids and the
        # engine's negotiated ADD_SET requests then agree everywhere.
        sets = [add_process_set(topo.node_ranks(node)) for node in range(topo.num_nodes)]
        mine = sets[topo.node_index]
        _cached = (state, mine)
        return mine


def resolve_scope(scope: Any) -> ProcessSet:
    """Turn a communication scope into a registered ProcessSet.

    Args:
        scope: ``"global"`` or ``1`` (every rank), ``"local"`` or ``0`` (this node's ranks,
            collective on first use, see :func:`local_process_set`), or a registered
            ProcessSet.

    Raises:
        ValueError: an unknown scope name or number, or an unregistered ProcessSet.
        TypeError: a scope of another type.
    """
    if isinstance(scope, ProcessSet):
        if scope.process_set_id is None:
            raise ValueError(f"comm_scope={scope!r} is not registered; call add_process_set first")
        return scope
    return local_process_set() if check_scope(scope) == LOCAL else global_process_set


def check_scope(scope: Any) -> str:
    """Validate a scope given by name or number without communicating; return its name.

    Raises:
        ValueError: an unknown scope name or number.
        TypeError: neither a string, an int, nor a ProcessSet.
    """
    if isinstance(scope, ProcessSet):
        return "process_set"
    if isinstance(scope, bool):
        raise TypeError(f"comm_scope must be 'global', 'local', 1, 0 or a ProcessSet, "
                        f"got {scope!r}")
    if isinstance(scope, int):
        if scope in (0, 1):
            return LOCAL if scope == 0 else GLOBAL
        raise ValueError(f"comm_scope={scope!r}: use 1 (global) or 0 (local)")
    if isinstance(scope, str):
        name = scope.strip().lower()
        if name in (GLOBAL, LOCAL):
            return name
        raise ValueError(f"comm_scope={scope!r}: use 'global' or 'local'")
    raise TypeError(f"comm_scope must be 'global', 'local', 1, 0 or a ProcessSet, "
                    f"got {type(scope).__name__}")


__all__ = ["GLOBAL", "LOCAL", "check_scope", "local_process_set", "resolve_scope"]
