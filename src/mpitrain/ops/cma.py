"""Cross-memory attach: read a peer process's memory directly (Linux ``process_vm_readv``).

With it a rank reads a peer's private buffer in one copy (no staging through a shared
segment), which is what lets the shared-memory allreduce work on any buffer the caller hands
in, such as a freshly allocated torch tensor.  The kernel allows it between processes of the
same user when ptrace would be allowed (``kernel.yama.ptrace_scope`` <= 1 for siblings, or
root); :func:`probe` finds out once per node, collectively, so all ranks take the same path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

import numpy as np
from mpi4py import MPI


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc: Any = None
_readv: Any = None


def _load() -> Any:
    global _libc, _readv
    if _readv is None and sys.platform.startswith("linux"):
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(_libc, "process_vm_readv", None)
        if fn is not None:
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                           ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
            _readv = fn
    return _readv


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def read(pid: int, remote: int, dst: np.ndarray) -> None:
    """Copy ``dst.nbytes`` bytes at address ``remote`` of process ``pid`` into ``dst``.

    Raises:
        OSError: the kernel refused (permissions) or the address is not mapped there.
    """
    nbytes = dst.nbytes
    if nbytes == 0:
        return
    fn = _load()
    if fn is None:
        raise OSError("process_vm_readv is not available on this platform")
    base = address(dst)
    done = 0
    while done < nbytes:  # the kernel may return short reads for very large requests
        local = _IoVec(base + done, nbytes - done)
        peer = _IoVec(remote + done, nbytes - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(peer), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got


def probe(comm: Any) -> bool:
    """True on every rank of ``comm`` (one node) when each can read every other's memory.

    Collective over ``comm``.  Each rank publishes a marker and reads every peer's; the answer
    is the logical and over all ranks, so the whole node agrees.
    """
    marker = np.full(8, comm.Get_rank() + 1, dtype=np.uint8)
    peers = comm.allgather((os.getpid(), address(marker)))
    ok = True
    probe_buf = np.empty(8, dtype=np.uint8)
    for r, (pid, addr) in enumerate(peers):
        if r == comm.Get_rank():
            continue
        try:
            read(pid, addr, probe_buf)
            ok = ok and bool((probe_buf == r + 1).all())
        except OSError:
            ok = False
    agreed = comm.allreduce(1 if ok else 0, op=MPI.MIN) == 1
    return agreed
