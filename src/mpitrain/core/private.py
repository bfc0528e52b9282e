"""Files mpitrain writes about a job are its user's alone: 0600 files in 0700 directories.

A timeline names every tensor and when it moved, an autotune log the job's settings, the
elastic control files which hosts run the job; on a shared machine, none of that is anyone
else's business.  The modes are set whatever the umask, since a umask of 022 (the usual one)
would leave them readable by every user.  A directory that already existed is left as it was
(it may be the user's working directory); one made here is 0700.
"""

from __future__ import annotations

import os
from typing import IO, Any

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_dirs(directory: str) -> None:
    """Create ``directory`` and missing parents, each one made here 0700."""
    directory = os.path.abspath(directory)
    missing = []
    while not os.path.isdir(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process: theirs to keep
        os.chmod(path, DIR_MODE)  # mkdir's mode passes through the umask


def open_file(path: str, mode: str = "w", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for writing (``w``, ``a``, ``x``; text or binary), the file 0600
    whether it is new or was there before (it is about to hold this job's details)."""
    if not any(m in mode for m in "wax"):
        raise ValueError(f"open_file is for writing, not mode {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT
    if "w" in mode:
        flags |= os.O_TRUNC
    elif "a" in mode:
        flags |= os.O_APPEND
    else:
        flags |= os.O_EXCL
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # O_CREAT's mode passes through the umask, and an old file
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


__all__ = ["DIR_MODE", "FILE_MODE", "make_dirs", "open_file"]
