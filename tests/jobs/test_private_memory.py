"""Shared memory in a running job is its user's alone: every file-backed shared mapping of a
rank (Open MPI's shared-memory transport, the MPI-3 window the shm allreduce stages through
where cross-memory attach is refused, PMIx's data) is 0600 and owned by the user, and Open
MPI's session directory is 0700.  Read from the kernel (/proc/self/maps), not from our code.
(Files mpitrain writes itself: tests/unit/test_private_files.py.)
"""

from __future__ import annotations

import json
import sys
import textwrap

from support import run_python

PROBE = textwrap.dedent("""
    import json, os, stat
    import numpy as np
    from mpi4py import MPI
    from mpitrain import collectives, session
    from mpitrain.core import runtime
    from mpitrain.ops.shm import Node

    session.init()
    big = np.ones(1 << 21, dtype=np.float32)  # 8 MiB: past MPI's own, onto the shm path
    for i in range(3):
        collectives.allreduce(big, name=f"big.{i}")
    node = Node(runtime.state().comms.local)
    node.segments(1 << 20)  # the staging window used where cross-memory attach is refused
    seen = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[1][3] == "s" and "w" in parts[1]:
                path = parts[5].strip().removesuffix(" (deleted)")
                try:
                    st = os.stat(path)
                    seen[path] = [oct(stat.S_IMODE(st.st_mode)), st.st_uid]
                except OSError:
                    seen[path] = "unlinked"  # mapped, no name left: nobody else can open it
    session_dir = os.environ.get("PMIX_SERVER_TMPDIR", "")
    mode = oct(stat.S_IMODE(os.stat(session_dir).st_mode)) if session_dir else None
    print("MAPPED", json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "uid": os.getuid(),
                                "maps": seen, "session_dir": [session_dir, mode]}), flush=True)
    node.close()
""")


def test_shared_segments_and_the_session_directory_are_private():
    result = run_python(2, PROBE, timeout=120)
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
               if line.startswith("MAPPED ")]
    assert sorted(r["rank"] for r in reports) == [0, 1], result.stdout
    for report in reports:
        named = {p: v for p, v in report["maps"].items() if v != "unlinked"}
        # Open MPI's shared-memory transport at least: the check must have looked at something.
        assert any("/dev/shm/" in p or "/tmp/" in p for p in named), report
        for path, (mode, uid) in named.items():
            assert mode == "0o600" and uid == report["uid"], (path, mode, uid)
        directory, mode = report["session_dir"]
        assert directory and mode == "0o700", report
    print(json.dumps(reports, indent=1), file=sys.stderr)
