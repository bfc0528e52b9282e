"""Rank-0 checkpoints: written once, atomically; read once and broadcast; resumed exactly.

    hvd.save_checkpoint("ckpt/step-{step:06d}.pt", model=model, optimizer=opt,
                        sampler=sampler, keep_last=3, epoch=epoch, step=step)
    extra = hvd.load_checkpoint("ckpt/step-{step:06d}.pt", model=model, optimizer=opt,
                                sampler=sampler)          # the newest one; extra["step"]

Both are collective.  Saving gathers every rank's random-number states (torch, CUDA, numpy,
Python's ``random``) and sampler position, and rank 0 writes model, optimizer, those states and
the keyword extras in one file (temporary file, fsync, rename, fsync of the directory: killing
the job mid-write leaves the previous checkpoint as it was).  Loading reads the file on rank 0
only, broadcasts its bytes, and restores everything on every rank, each rank getting its own
random states back, so a resumed run continues bit for bit as if it had never stopped.
A stateful compressor (PowerSGD, top-k, 1-bit: error memories that differ between ranks) is
saved per rank too: the optimizer's own (``DistributedOptimizer(compression=...)``) or the one
given as ``compressor=`` (a DDP model's comm hook).
The model is rank 0's: buffers that ranks keep for themselves (BatchNorm running statistics
without SyncBatchNorm) come back as rank 0's on every rank.  A DataLoader draws from torch's
global generator whenever an iteration starts; give it ``generator=torch.Generator()`` so that
resuming mid-epoch (one extra start) does not shift the random stream.  With more than two
ranks, floating-point sums depend on which gradients the engine fused together, which depends
on timing: for bitwise-reproducible runs fix the fusion with ``DistributedOptimizer(...,
groups=1)`` (two ranks are exact either way).

Files are written with ``torch.save`` and read with ``weights_only=False`` (they hold numpy
random states): load only checkpoints you wrote.
"""

from __future__ import annotations

import glob
import io
import os
import random
import re
import warnings
from typing import Any

import numpy as np
import torch

from ..collectives import allgather_object, broadcast_object
from ..core import runtime
from ..face import files

FORMAT = "mpitrain-checkpoint"
VERSION = 1
_FIELD = re.compile(r"\{[^{}]*\}")


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sampler_state(sampler: Any) -> dict[str, Any] | None:
    if sampler is None:
        return None
    if hasattr(sampler, "state_dict"):
        return dict(sampler.state_dict())
    if hasattr(sampler, "epoch"):
        return {"epoch": int(sampler.epoch)}
    raise TypeError(f"sampler must have state_dict() or an epoch (a DistributedSampler), got "
                    f"{type(sampler).__name__}")


def _restore_sampler(sampler: Any, state: dict[str, Any] | None) -> None:
    if state is None:
        raise ValueError("the checkpoint holds no sampler position (saved without sampler=)")
    if hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(state)
    else:
        sampler.set_epoch(state["epoch"])


def _compressor(optimizer: Any, compressor: Any) -> Any:
    """The stateful compressor to save or restore: the one given, else the optimizer's."""
    return compressor if compressor is not None else getattr(optimizer, "compressor", None)


def checkpoint_glob(path: str | os.PathLike[str]) -> str:
    """The glob matching every file a path template names (``{step}`` -> ``*``)."""
    return _FIELD.sub("*", os.fspath(path))


def latest_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """The newest existing file that ``path`` (a template or a plain path) names, or None.

    Not collective; reads this rank's view of the file system.
    """
    candidates = [p for p in glob.glob(checkpoint_glob(path)) if os.path.isfile(p)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (os.stat(p).st_mtime_ns, p))


def _check_keep_last(path: str, keep_last: Any) -> int | None:
    if keep_last is None:
        return None
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be a positive integer or None, got {keep_last!r}")
    if not _FIELD.search(path):
        raise ValueError(f"keep_last={keep_last} needs a path template with a field that "
                         f"changes between saves (e.g. 'ckpt-{{step}}.pt'), got {path!r}")
    return keep_last


def _prune(path: str, keep_last: int) -> None:
    found = sorted((p for p in glob.glob(checkpoint_glob(path)) if os.path.isfile(p)),
                   key=lambda p: (os.stat(p).st_mtime_ns, p))
    for old in found[:-keep_last]:
        os.unlink(old)
    if found[:-keep_last]:
        files.fsync_directory(os.path.dirname(os.path.abspath(path)))


def save_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, sampler: Any = None,
                    keep_last: int | None = None, compressor: Any = None,
                    **extra: Any) -> str:
    """Write a checkpoint on rank 0, atomically; return the path written.

    Args:
        path: the file; may be a template filled from ``extra`` (``"ckpt-{step:06d}.pt"``).
        model: its ``state_dict()`` (rank 0's; data-parallel ranks hold equal models).
        optimizer: its ``state_dict()`` (a DistributedOptimizer's too).
        sampler: records every rank's position (see :class:`DistributedSampler`), or the
            epoch of a torch ``DistributedSampler``.
        keep_last: afterwards keep only the newest ``keep_last`` files the template names.
        compressor: a stateful compressor not owned by ``optimizer`` (a DDP comm hook's);
            every rank's state is saved.
        **extra: anything picklable (epoch, step, metrics); returned by ``load_checkpoint``.

    Raises:
        ValueError: bad ``keep_last``, or a template field missing from ``extra``.
        OSError: the write failed on rank 0 (raised on every rank).

    Warning:
        Collective: every rank must call it (it gathers random states and ends together).
    """
    template = os.fspath(path)
    keep = _check_keep_last(template, keep_last)
    try:
        target = template.format(**extra) if _FIELD.search(template) else template
    except (KeyError, IndexError) as exc:
        raise ValueError(f"checkpoint path {template!r} names {exc} which is not among the "
                         f"extras {sorted(extra)}") from None
    stateful = _compressor(optimizer, compressor)
    mine = {"rng": _rng_state(), "sampler": _sampler_state(sampler),
            "compressor": stateful.state_dict() if stateful is not None else None}
    ranks = allgather_object(mine)
    error = None
    if runtime.rank() == 0:
        content = {"format": FORMAT, "version": VERSION, "world_size": runtime.size(),
                   "model": model.state_dict() if model is not None else None,
                   "optimizer": optimizer.state_dict() if optimizer is not None else None,
                   "ranks": ranks, "extra": extra}
        try:
            files.write_atomic(target, lambda f: torch.save(content, f))
            if keep is not None:
                _prune(template, keep)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = broadcast_object(error, root_rank=0)
    if error is not None:
        raise OSError(f"rank 0 could not write checkpoint {target!r}: {error}")
    return os.path.abspath(target)


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, sampler: Any = None,
                    restore_rng: bool = True, map_location: Any = "cpu",
                    compressor: Any = None) -> dict[str, Any]:
    """Read a checkpoint on rank 0, broadcast it, restore it everywhere; return its extras.

    Args:
        path: a file, or a template (the newest file it names is loaded).
        model: restored in place when given.
        optimizer: restored in place when given.
        sampler: restored in place when given.
        restore_rng: give every rank its saved random states back (each its own; with a
            different world size now, ranks beyond the saved ones keep theirs).
        map_location: passed to ``torch.load``.
        compressor: a stateful compressor not owned by ``optimizer`` (as saved).

    Returns:
        The keyword extras of :func:`save_checkpoint` (epoch, step, ...), plus ``"path"``.

    Raises:
        FileNotFoundError: on every rank, when rank 0 finds no such checkpoint.
        ValueError: on every rank, when the file is not an mpitrain checkpoint, or lacks the
            model/optimizer/sampler asked for.

    Warning:
        Collective: every rank must call it.
    """
    payload: Any = None
    if runtime.rank() == 0:
        found = latest_checkpoint(path) if _FIELD.search(os.fspath(path)) else os.fspath(path)
        try:
            if found is None:
                raise FileNotFoundError(f"no checkpoint matches {os.fspath(path)!r}")
            payload = (found, files.read(found))
        except OSError as exc:
            payload = ("error", f"{type(exc).__name__}: {exc}")
    payload = broadcast_object(payload, root_rank=0)
    if payload[0] == "error":
        raise FileNotFoundError(f"rank 0 could not read checkpoint {os.fspath(path)!r}: "
                                f"{payload[1]}")
    found, data = payload
    try:
        ckpt = torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise ValueError(f"{found!r} is not a readable checkpoint: {exc}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise ValueError(f"{found!r} is not an mpitrain checkpoint")
    for what, obj in (("model", model), ("optimizer", optimizer)):
        if obj is not None and ckpt[what] is None:
            raise ValueError(f"{found!r} holds no {what} state (saved without {what}=)")
    if model is not None:
        model.load_state_dict(ckpt["model"])
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    ranks = ckpt["ranks"]
    me = runtime.rank()
    mine = ranks[me] if me < len(ranks) else None
    if len(ranks) != runtime.size() and me == 0:
        warnings.warn(f"checkpoint {found!r} was saved by {len(ranks)} ranks and is loaded by "
                      f"{runtime.size()}: random streams and sampler positions cannot continue "
                      "exactly", stacklevel=2)
    if sampler is not None:
        _restore_sampler(sampler, (mine or ranks[0])["sampler"])
    stateful = _compressor(optimizer, compressor)
    if stateful is not None:
        # Decided alike on every rank (the file and world size are the same everywhere).
        if len(ranks) != runtime.size():
            raise ValueError(f"{found!r} was saved by {len(ranks)} ranks; its compressor's "
                             f"per-rank error memory cannot be restored on {runtime.size()}")
        saved = ranks[me].get("compressor")
        if saved is None:
            raise ValueError(f"{found!r} holds no compressor state (saved without a "
                             "stateful compressor)")
        stateful.load_state_dict(saved)
    if restore_rng and mine is not None:
        _set_rng_state(mine["rng"])
    return dict(ckpt["extra"], path=found)


__all__ = ["checkpoint_glob", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
