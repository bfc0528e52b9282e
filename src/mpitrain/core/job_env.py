"""Tell torch.distributed-based libraries what MPI knows: the job's layout in the environment.

Hugging Face's Trainer and Accelerate, Lightning and torchrun-style scripts decide whether a run
is distributed, and how to split the data, from ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; ``mpirun`` sets none of them, so under mpirun those libraries used to see
a world of one and train one model per rank without a word.  Once ``init()`` knows the job,
:func:`export` writes MPI's numbers there.

On a machine without a GPU, Accelerate only treats a run as distributed when told to use the
CPU (what ``accelerate launch --cpu`` does through ``ACCELERATE_USE_CPU``); without it a CPU job
under mpirun trains separate replicas.  :func:`export` sets it too, unless the user did.

Nothing here imports torch: :func:`check_torch_world` looks at torch.distributed only if the
program has imported it already.
"""

from __future__ import annotations

import os
import sys

LAYOUT_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

# name -> (the value before export, or None; the value exported), for withdraw().
_exported: dict[str, tuple[str | None, str]] = {}


def export(rank: int, size: int, local_rank: int, local_size: int, has_gpu: bool) -> None:
    """Write the job's layout where libraries look for it (see the module docstring).

    MPI's numbers replace whatever was there (an outer launcher's, or a user's): the launcher
    check at ``init()`` (:mod:`mpitrain.core.launchers`) has already refused the combinations that
    cannot work, and libraries must see the world that actually runs.  :func:`withdraw` puts
    the previous values back.
    """
    withdraw()  # what an earlier init() exported is not somebody else's setting
    values = dict(zip(LAYOUT_VARIABLES, (rank, size, local_rank, local_size)))
    exports = {name: str(value) for name, value in values.items()}
    if size > 1 and not has_gpu and "ACCELERATE_USE_CPU" not in os.environ:
        exports["ACCELERATE_USE_CPU"] = "true"
    for name, text in exports.items():
        _exported[name] = (os.environ.get(name), text)
        os.environ[name] = text


def withdraw() -> None:
    """Undo :func:`export` (at shutdown): restore each variable it changed, unless changed since."""
    for name, (before, ours) in list(_exported.items()):
        if os.environ.get(name) == ours:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
        del _exported[name]


def check_torch_world(size: int) -> None:
    """Refuse a torch.distributed default group whose world differs from MPI's.

    A default group of another size (created with a hand-set ``WORLD_SIZE``, or by a launcher
    that started fewer processes than MPI sees) would make DDP average over the wrong ranks,
    or over none.

    Raises:
        ValueError: torch.distributed is initialised with a world size other than ``size``.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    torch_size = dist.get_world_size()
    if torch_size != size:
        raise ValueError(
            f"torch.distributed is initialised with world size {torch_size}, but MPI runs "
            f"{size} processes: models would train apart.  Initialise torch.distributed after "
            "mpitrain, from MPI: torch.distributed.init_process_group('mpitrain') (or "
            "mpitrain.torch.distributed.init_process_group()), and leave WORLD_SIZE/RANK unset.")


__all__ = ["LAYOUT_VARIABLES", "check_torch_world", "export", "withdraw"]
