"""``horovod.torch`` with Horovod 0.28.1's exact signatures, running on mpitrain.

Put ``tests/fake_horovod`` on PYTHONPATH to drive a script's Horovod path where Horovod is not
installed.  It checks how the script calls Horovod, not Horovod itself: each function takes
only the arguments the 0.28.1 one takes (read from horovod/torch/functions.py, mpi_ops.py,
optimizer.py and common/basics.py of v0.28.1), so a keyword Horovod lacks is a TypeError here
as it is there, and ``add_process_set`` needs ``init(process_sets="dynamic")`` first.
"""

from __future__ import annotations

from typing import Any

import mpitrain

Average = mpitrain.Average
Sum = mpitrain.Sum
Compression = mpitrain.Compression
global_process_set = mpitrain.global_process_set
synchronize = mpitrain.synchronize
rank = mpitrain.rank
size = mpitrain.size
_dynamic = False


def init(comm: Any = None, process_sets: Any = None) -> None:
    global _dynamic
    _dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    mpitrain.init(comm)


def add_process_set(process_set: Any) -> Any:
    if not _dynamic:
        raise ValueError("Horovod needs HOROVOD_DYNAMIC_PROCESS_SETS (init(process_sets="
                         "'dynamic')) to add a process set after init")
    return mpitrain.add_process_set(process_set)


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    return mpitrain.broadcast_async_(tensor, root_rank, name=name, process_set=process_set)


def broadcast_parameters(params: Any, root_rank: int) -> None:
    if isinstance(params, dict):
        params = sorted(params.items())
    handles = [broadcast_async_(p, root_rank, name) for name, p in params]
    for handle in handles:
        synchronize(handle)


def DistributedOptimizer(optimizer: Any, named_parameters: Any = None,  # noqa: N802 - Horovod's
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set) -> Any:
    return mpitrain.DistributedOptimizer(
        optimizer, named_parameters=named_parameters, compression=compression,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
        groups=groups, sparse_as_dense=sparse_as_dense, process_set=process_set)
