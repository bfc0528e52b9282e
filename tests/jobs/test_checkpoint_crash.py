"""kill -9 in the middle of writing a checkpoint leaves the previous one loadable.

A child process saves checkpoint A, then starts overwriting it with B through a writer slowed
down to stop halfway (half of B's bytes on disk, fsynced); the test SIGKILLs it there, then a
fresh process loads the path and must get A, intact; a later save clears the orphaned
temporary file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from support import job_env

SAVE_THEN_HANG = textwrap.dedent("""
    import io, os, sys, time
    import torch
    import mpitrain as hvd

    hvd.init()
    path = sys.argv[1]
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.fill_(1.0)
    hvd.save_checkpoint(path, model=model, step=1)          # A: complete

    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):                 # B: stops halfway
        if isinstance(f, io.BytesIO):  # torch pickling storages in memory: leave alone
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        print("HALF-WRITTEN", flush=True)
        time.sleep(120)

    torch.save = slow_save
    with torch.no_grad():
        model.weight.fill_(2.0)
    hvd.save_checkpoint(path, model=model, step=2)
""")

LOAD = textwrap.dedent("""
    import sys
    import torch
    import mpitrain as hvd

    hvd.init()
    model = torch.nn.Linear(64, 64)
    extra = hvd.load_checkpoint(sys.argv[1], model=model)
    assert extra["step"] == 1, extra
    assert bool((model.weight == 1.0).all()), "checkpoint A came back altered"
    if len(sys.argv) > 2:
        hvd.save_checkpoint(sys.argv[1], model=model, step=3)
    print("LOADED", extra["step"])
""")


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    writer = _python(SAVE_THEN_HANG, str(path))
    try:
        assert writer.stdout is not None
        line = writer.stdout.readline()
        assert line.strip() == "HALF-WRITTEN", (line, writer.stderr.read() if writer.stderr
                                                 else "")
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        if writer.poll() is None:
            writer.kill()
        writer.communicate(timeout=60)
    assert writer.returncode == -signal.SIGKILL
    orphans = [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.tmp-")]
    assert len(orphans) == 1, sorted(os.listdir(tmp_path))  # B's half, never renamed

    loader = _python(LOAD, str(path), "--save-again")
    out, err = loader.communicate(timeout=120)
    assert loader.returncode == 0, out + err
    assert "LOADED 1" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # orphan cleared
