"""Python's cyclic garbage collector, told to leave alone the objects that exist at init().

A process that has imported torch tracks about 270,000 container objects (its modules,
functions, classes), and Python's collector examines every one of them in each full
collection: 112 ms on this machine's cores.  It runs a full collection whenever the objects
that survived younger collections since the last one exceed a quarter of the survivors of
the last; a backward pass of per-tensor asynchronous allreduces keeps each request's handle,
request, entry and output tensor alive across several younger collections, so it brought a
full collection every ten steps of 1,000 tensors (11 us per tensor on average, and a 112 ms
stall in the step it hit; 2 ranks, ``benchmarks/engine_overhead.py``, 2026-11-29).

:func:`freeze_imports`, at a process's first init(), collects once and then calls
``gc.freeze()``: the objects alive then move to the collector's permanent generation, and a
full collection examines only what was created since (0.6 ms instead of 112 in the same run).
The price: an object alive at that init() that later becomes part of an unreachable cycle is
never freed (``gc.unfreeze()`` hands them back).  What is alive then is the imports and what
the script built before calling init(), so the memory that can be held this way is bounded and
does not grow as training runs; the collection first frees what is garbage already (frozen,
an unclosed socket in a cycle would stay open until exit).  Later init()s (an elastic reset,
in the middle of training) freeze nothing more.  Forked workers (torch's DataLoader) also share
the frozen objects' pages instead of copying them, the use CPython documents for
``gc.freeze``.  ``MPITRAIN_GC_FREEZE=0`` leaves the collector as it is.
"""

from __future__ import annotations

import gc

_frozen = False  # this process froze once already


def freeze_imports(enabled: bool) -> bool:
    """Collect, then move every object the collector tracks into its permanent generation
    (see the module docstring); the first call of a process only.

    Returns:
        Whether it froze (False when ``enabled`` is False, the collector is disabled (a
        process that turned it off manages its memory itself), or it froze before).
    """
    global _frozen
    if not enabled or not gc.isenabled() or _frozen:
        return False
    _frozen = True
    gc.collect()
    gc.freeze()
    return True


__all__ = ["freeze_imports"]
