"""Which group torch's own communication hooks reduce over when the drop-in runs them.

torch's hooks (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``, ``batched_powerSGD_hook``, the fp16/bf16 wrappers, ...) take their process
group from their state and fall back to torch's default group (``dist.group.WORLD``) when it is
``None``.  A Horovod-style script calls only ``hvd.init()``: there is no default group, and the
hook would fail inside backward.  So the first time such a hook runs, the drop-in creates
torch's default group over mpitrain (:func:`mpitrain.torch.c10d.init_default_group`), at the
end of the first hooked backward, a point every rank of the job reaches in the same order as
its other collectives.  That group spans every rank, so it is made only for a drop-in over
every rank; a drop-in over a process set must give its hook a torch group of the set's ranks.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ....core import runtime
from ....core.process_sets import ProcessSet, size_of
from ... import c10d

_TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"


def uses_default_group(state: Any, hook: Any) -> bool:
    """Whether ``hook`` is one of torch's built-in hooks that will use torch's default group:
    its state is the group itself and is None, or has a ``process_group`` that is None."""
    if not getattr(hook, "__module__", "").startswith(_TORCH_HOOKS):
        return False
    return state is None or (hasattr(state, "process_group") and state.process_group is None)


def _spans_the_job(process_set: ProcessSet) -> bool:
    return size_of(process_set) == runtime.size()


def check_hook_group(state: Any, hook: Any, process_set: ProcessSet) -> None:
    """Refuse, at registration, a default-group torch hook on a drop-in over fewer ranks.

    Raises:
        ValueError: the hook would reduce over every rank but the drop-in over ``process_set``.
    """
    if uses_default_group(state, hook) and not _spans_the_job(process_set):
        raise ValueError(
            f"{getattr(hook, '__name__', hook)!r} has no process group (None), so it would "
            f"reduce over torch's default group (every rank), but this DistributedDataParallel "
            f"reduces over {process_set!r}; give the hook a torch group of those ranks "
            f"(torch.distributed.new_group({process_set.ranks}) after mpitrain.init())")


def ensure_default_group_for(state: Any, hook: Any, process_set: ProcessSet) -> None:
    """Create torch's default group over mpitrain if ``hook`` needs one and there is none.

    Collective over every rank (see the module docstring); the drop-in calls it once, before
    its first hooked reduction.
    """
    if uses_default_group(state, hook) and not dist.is_initialized() \
            and _spans_the_job(process_set):
        c10d.init_default_group()


__all__ = ["check_hook_group", "ensure_default_group_for", "uses_default_group"]
