"""Optimizer-state files: written by rank 0 atomically, read by every rank."""

from __future__ import annotations

import os
import tempfile

from .. import collectives as C
from .. import runtime


def save_on_rank0(fname: str | os.PathLike[str], data: bytes) -> None:
    """Rank 0 writes ``data`` to ``fname`` (temp file, fsync, rename); then all ranks meet.

    Collective: every rank must call it, so that no rank reads the file before it exists.
    The failure of the write on rank 0 raises there (and the job's abort hook ends the rest).
    """
    if runtime.rank() == 0:
        path = os.path.abspath(os.fspath(fname))
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a crash
        finally:
            os.close(dir_fd)
    C.barrier()


def read(fname: str | os.PathLike[str]) -> bytes:
    """The file's bytes.

    Raises:
        FileNotFoundError: it does not exist (on this rank's view of the file system).
    """
    with open(fname, "rb") as f:
        return f.read()
