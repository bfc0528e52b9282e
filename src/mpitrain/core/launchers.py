"""Refuse a job that a launcher started as N processes but MPI sees as N worlds of one.

mpitrain's processes find each other through MPI.  A launcher that is not MPI's (torchrun,
``srun`` without PMI wiring, horovodrun with Gloo) or an MPI launcher of a different library than
the one mpi4py loaded starts N processes, each of which MPI then initialises as a *singleton*:
rank 0 of 1.  Training would go on as N unrelated models, with no error.  So ``init()`` compares
MPI's world with what the launcher's environment says, and when the launcher says N > 1 and MPI
says 1, every process raises :class:`LauncherMismatchError` naming what was detected, why it
cannot work and the command that does.  ``MPITRAIN_ALLOW_SINGLETON=1`` turns the check off.

Launchers nest (srun starts torchrun, srun starts Open MPI's daemons which start the ranks), so
the environment is read from the innermost launcher outwards and the first one that states a
world size decides: under ``mpirun -np 1`` inside a Slurm step of 4 tasks, Open MPI's
``OMPI_COMM_WORLD_SIZE=1`` wins and a world of one is right.  A plain ``python train.py`` has
none of these variables and stays a world of one.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import MpitrainInternalError

ALLOW_VARIABLE = "MPITRAIN_ALLOW_SINGLETON"

# Slurm numbers its special steps near 2**32 (batch script, extern, interactive step): a process
# in one of those was not started by ``srun`` as a task of a parallel step.
_SLURM_SPECIAL_STEP_MIN = 0xFFFFFFF0


class LauncherMismatchError(MpitrainInternalError):
    """A launcher started several processes, but MPI initialised this one alone."""

    def __init__(self, message: str, printed: str | None = None,
                 headline: str | None = None) -> None:
        super().__init__(message)
        # What an uncaught error prints: the message on the launcher's rank 0, one line elsewhere.
        self.printed = message if printed is None else printed
        self.headline = headline or message.splitlines()[0]


@dataclass(frozen=True)
class Launcher:
    """One launcher's variables: which state the world size and this process's rank."""

    name: str
    kind: str  # "mpi", "slurm", "torch" or "gloo": decides the advice
    size_variables: tuple[str, ...]  # world size first, then local sizes (lower bounds)
    rank_variables: tuple[str, ...]


# Innermost first: an MPI launcher is never started by torchrun, torchrun often by srun.
LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("Open MPI's mpirun", "mpi", ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
             ("OMPI_COMM_WORLD_RANK",)),
    Launcher("a PMI launcher (MPICH or Intel MPI mpiexec, or srun --mpi=pmi2)", "mpi",
             ("PMI_SIZE", "MPI_LOCALNRANKS"), ("PMI_RANK",)),
    Launcher("MVAPICH2's launcher", "mpi", ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"),
             ("MV2_COMM_WORLD_RANK",)),
    Launcher("IBM jsrun", "mpi", ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_SIZE"),
             ("JSM_NAMESPACE_RANK",)),
    # PMIx and Cray PALS put only the rank in the environment.
    Launcher("a PMIx launcher (srun --mpi=pmix, prterun)", "mpi", (), ("PMIX_RANK",)),
    Launcher("HPE Cray PALS (aprun/mpiexec)", "mpi", (), ("PALS_RANKID",)),
    Launcher("horovodrun with Gloo", "gloo", ("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"),
             ("HOROVOD_RANK",)),
    Launcher("torchrun", "torch", ("WORLD_SIZE", "LOCAL_WORLD_SIZE"), ("RANK", "LOCAL_RANK")),
    Launcher("a Slurm step (srun)", "slurm",
             ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), ("SLURM_PROCID",)),
)


@dataclass(frozen=True)
class Claim:
    """What the deciding launcher says: at least ``size`` processes, this one ``rank``."""

    launcher: Launcher
    name: str
    size: int
    rank: int | None
    evidence: tuple[str, ...]  # NAME=VALUE as read
    in_slurm_step: bool = False  # srun started this process (whatever the claim's launcher)


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None


def _in_slurm_task_step(env: Mapping[str, str]) -> bool:
    """True inside a parallel step started by srun (not the batch script or salloc's shell)."""
    step = _int(env, "SLURM_STEP_ID")
    if step is None:
        step = _int(env, "SLURM_STEPID")
    return step is not None and 0 <= step < _SLURM_SPECIAL_STEP_MIN


def _present(launcher: Launcher, env: Mapping[str, str]) -> bool:
    if launcher.kind == "slurm":
        return _in_slurm_task_step(env)
    names = launcher.size_variables + launcher.rank_variables
    return any(_int(env, n) is not None for n in names)


def detect(environ: Mapping[str, str] | None = None) -> Claim | None:
    """Return the innermost launcher's claim when it says this world has more than one process.

    The first launcher, innermost out, that states a size decides (``None`` when that size is
    1).  One that states only a rank (PMIx, PALS) lets the next one out decide, and proves a
    world of at least rank + 1 when none does.  No launcher at all gives ``None``: a plain
    ``python train.py``.
    """
    env = os.environ if environ is None else environ
    in_slurm = _in_slurm_task_step(env)
    fallback: Claim | None = None
    for launcher in LAUNCHERS:
        if not _present(launcher, env):
            continue
        seen = [(n, _int(env, n)) for n in launcher.size_variables + launcher.rank_variables]
        evidence = tuple(f"{n}={v}" for n, v in seen if v is not None)
        sizes = [v for n, v in seen if n in launcher.size_variables and v is not None]
        ranks = [v for n, v in seen if n in launcher.rank_variables and v is not None]
        rank = ranks[0] if ranks else None
        name = launcher.name
        if launcher.kind == "torch" and not any(k.startswith("TORCHELASTIC_") for k in env):
            name = "a torch.distributed launcher (WORLD_SIZE/RANK)"
        if not sizes:
            # Only a rank: above 0 it proves a larger world; an outer launcher may say how large.
            if rank is not None and rank > 0 and fallback is None:
                fallback = Claim(launcher, name, rank + 1, rank, evidence, in_slurm)
            continue
        # The world size, or failing that a local size; a rank proves at least rank + 1.
        size = max(sizes[0], (rank or 0) + 1)
        return Claim(launcher, name, size, rank, evidence, in_slurm) if size > 1 else fallback
    return fallback


def _command_line(argv: Sequence[str] | None) -> str:
    """The command this process runs, quoted to paste (``python train.py`` if unknown or long)."""
    words = list(argv) if argv is not None else list(getattr(sys, "orig_argv", []))
    text = shlex.join(words) if words else ""
    return text if text and len(text) <= 160 else "python train.py"


def library_name(version_text: str) -> str:
    """"Open MPI v5.0.11" or "MPICH 5.0.2" from MPI_Get_library_version's text."""
    first = version_text.strip().splitlines()[0] if version_text.strip() else "an MPI library"
    return " ".join(w for w in first.split(",")[0].split() if w != "Version:")


def _advice(claim: Claim, library: str, command: str) -> list[str]:
    n = claim.size
    name = library_name(library)
    open_mpi = "Open MPI" in library
    mpirun = f"mpirun -np {n} {command}" if open_mpi else f"mpiexec -n {n} {command}"
    kind = claim.launcher.kind
    why = {
        "torch": "torchrun starts the processes and a TCP store, but not MPI, and mpitrain's "
                 "processes find each other only through MPI.",
        "gloo": "horovodrun without MPI connects processes through Gloo, which mpitrain does "
                "not use; mpitrain's processes find each other only through MPI.",
        "slurm": f"srun started the tasks without the PMI wiring that {name} needs to join "
                 "them (its --mpi= plugin, or the site's default, does not serve that library).",
        "mpi": f"a launcher only joins processes of its own MPI library (or PMI flavour), and "
               f"mpi4py loaded {name}.",
    }[kind]
    lines = [why, "Each process would train alone on its own copy of the model. Launch with:",
             f"    mpitrainrun -np {n} {command}"]
    if claim.in_slurm_step:
        lines.append(f"    srun --mpi={'pmix' if open_mpi else 'pmi2'} -n {n} {command}")
    else:
        lines.append(f"    {mpirun}")
    if kind == "mpi":
        lines.append("(the launcher must be that of the MPI library mpi4py loaded; or build "
                     "mpi4py against the launcher's MPI: pip install --no-binary=mpi4py mpi4py)")
    if kind == "torch":
        lines += ["Where a scheduler starts one task per node and there is no mpirun (HPC Pack, "
                  "Kubernetes, AWS Batch, Slurm without PMI), put mpitrainrun where the task "
                  "line says torchrun, with the same endpoint:",
                  f"    mpitrainrun {_per_node(claim)} --rdzv-endpoint HOST:PORT {command}",
                  "(docs/guide/rendezvous.md)."]
    return lines


def _per_node(claim: Claim) -> str:
    """``--nnodes N --nproc-per-node K`` as torchrun's variables tell them, where they do."""
    seen = dict(item.split("=", 1) for item in claim.evidence)
    local = seen.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) > 0 and claim.size % int(local) == 0:
        return f"--nnodes {claim.size // int(local)} --nproc-per-node {local}"
    return "--nnodes N --nproc-per-node K"


class Explanation(NamedTuple):
    """The words of a refusal: all of it, one line for ranks > 0, one line for torchrun's report."""

    message: str
    summary: str
    headline: str


def explain(claim: Claim, library: str, argv: Sequence[str] | None = None) -> Explanation:
    """Say what was detected, why it cannot work, and the command that does."""
    command = _command_line(argv)
    where = f"rank {claim.rank} of {claim.size}" if claim.rank is not None else \
        f"one of {claim.size} processes"
    head = (f"mpitrain: {claim.name} started {claim.size} processes "
            f"({', '.join(claim.evidence)}), but MPI sees a world of one in each: this process "
            f"is {where} for the launcher and rank 0 of 1 for MPI.")
    tail = f"To run each process alone on purpose, set {ALLOW_VARIABLE}=1."
    message = "\n".join([head, *_advice(claim, library, command), tail])
    fix = f"Launch with: mpitrainrun -np {claim.size} {command}"
    seen = f"mpitrain: {claim.name} started {claim.size} processes but MPI sees a world of one"
    return Explanation(message, f"{seen} ({where}); refused, see rank 0's message. {fix}",
                       f"{seen}; refused. {fix}")


def check_world(mpi_world_size: int, allow_singleton: bool, library: str,
                environ: Mapping[str, str] | None = None,
                argv: Sequence[str] | None = None) -> None:
    """Raise when MPI's world is one process but the launcher started several.

    Every process of a wrongly launched job raises, each on its own (there is no communicator
    joining them).  Uncaught, the error prints as its message alone, without a traceback, and
    only the launcher's rank 0 prints the whole explanation; the others print one line.

    Raises:
        LauncherMismatchError: MPI says 1, the innermost launcher says more, and
            ``allow_singleton`` is false.
    """
    if mpi_world_size != 1 or allow_singleton:
        return
    claim = detect(environ)
    if claim is None:
        return
    words = explain(claim, library, argv)
    _print_without_traceback()
    raise LauncherMismatchError(words.message,
                                words.summary if claim.rank not in (None, 0) else None,
                                words.headline)


_hook_installed = False


def _print_without_traceback() -> None:
    """Make an uncaught LauncherMismatchError print its text alone (every rank fails alike:
    N tracebacks through init() would bury the one thing to read)."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, LauncherMismatchError):
            sys.stderr.write(exc.printed + "\n")
            sys.stderr.flush()
            _report_to_torchrun(exc.headline)
            return
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _report_to_torchrun(headline: str) -> None:
    """Leave the reason where torchrun's failure summary looks for it.

    torchrun's agent reads a JSON reply file named by TORCHELASTIC_ERROR_FILE (``{"message":
    str, "timestamp": int}`` is one of the shapes it accepts) and prints the message as the root
    cause; without one its summary says only "To enable traceback see: ...".  An existing file
    was written by torch's own handler and is left alone.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": headline, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the message is on stderr already
