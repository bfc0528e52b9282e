"""Files written by rank 0 atomically: a crash mid-write leaves the previous version intact.

The one place that knows how to replace a file safely (used by torch checkpoints and by the
KVStore's optimizer-state files): write a temporary file next to the target, fsync it, rename
it over the target, fsync the directory so the rename itself survives a crash.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from .. import collectives
from ..core import runtime

Writer = Callable[[BinaryIO], None]


def temp_prefix(path: str | os.PathLike[str]) -> str:
    """The name prefix of :func:`write_atomic`'s temporary files for ``path``.

    Hidden (leading dot) so that a glob for the checkpoints themselves never matches one.
    """
    return f".{os.path.basename(os.fspath(path))}.tmp-"


def write_atomic(path: str | os.PathLike[str], write: Writer | bytes) -> str:
    """Replace ``path`` with new content, atomically; return the absolute path.

    Args:
        path: the file to create or replace (its directory is created if missing).
        write: the bytes, or a function that writes them into the open binary file it gets
            (e.g. ``lambda f: torch.save(obj, f)``), so large content is streamed, not copied.

    Not collective: whoever calls it writes.  Leftover temporary files of earlier, crashed
    writes of the same path are removed first.
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    prefix = temp_prefix(target)
    for name in os.listdir(directory):
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(write, (bytes, bytearray, memoryview)):
                f.write(write)
            else:
                write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)
    return target


def fsync_directory(directory: str) -> None:
    """Make renames and unlinks in ``directory`` durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_on_rank0(fname: str | os.PathLike[str], data: bytes) -> None:
    """Rank 0 writes ``data`` to ``fname`` atomically; then all ranks meet.

    Collective: every rank must call it, so that no rank reads the file before it exists.
    The failure of the write on rank 0 raises there (and the job's abort hook ends the rest).
    """
    if runtime.rank() == 0:
        write_atomic(fname, data)
    collectives.barrier()


def read(fname: str | os.PathLike[str]) -> bytes:
    """The file's bytes.

    Raises:
        FileNotFoundError: it does not exist (on this rank's view of the file system).
    """
    with open(fname, "rb") as f:
        return f.read()
