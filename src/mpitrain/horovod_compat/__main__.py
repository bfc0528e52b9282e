"""``python -m mpitrain.horovod_compat SCRIPT [ARGS...]``: run a Horovod script on mpitrain.

The script runs as ``python SCRIPT ARGS`` would run it (``__main__``, its directory first on
``sys.path``, ``sys.argv`` = SCRIPT ARGS), with ``import horovod...`` resolving to mpitrain.
Child processes it starts (DataLoader workers, subprocesses) see the stand-in too, through
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import SHIM_PATH, real_horovod, shadowing_note, with_shim_first

USAGE = ("usage: python -m mpitrain.horovod_compat SCRIPT [ARGS...]\n\n"
         "Run a Horovod script unchanged on mpitrain: `import horovod.torch as hvd`,\n"
         "`horovod.tensorflow`, `horovod.tensorflow.keras` and `horovod.keras` resolve to\n"
         "mpitrain's faces.  Launch it the MPI way, e.g.\n"
         "  mpirun -np 4 python -m mpitrain.horovod_compat train.py --epochs 3\n"
         "or with mpitrainrun --horovod-compat -np 4 python train.py.\n")


def _first_rank() -> bool:
    """Whether this process should print job-wide notes (rank 0, or no launcher)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        sys.exit(0 if args else 2)
    script = args[0]
    if not os.path.isfile(script):
        sys.stderr.write(f"python -m mpitrain.horovod_compat: no such script: {script!r}\n")
        sys.exit(2)
    horovod_dir = real_horovod()
    if horovod_dir is not None and _first_rank():
        sys.stderr.write(shadowing_note(horovod_dir) + "\n")
    os.environ["PYTHONPATH"] = with_shim_first(os.environ.get("PYTHONPATH"))
    sys.path[:] = [p for p in sys.path if p != SHIM_PATH]
    sys.path.insert(0, SHIM_PATH)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = list(args)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
