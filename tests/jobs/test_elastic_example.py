"""examples/pytorch/train_digits_elastic.py under ULFM: a rank SIGKILLed after epoch 2 (by
the pid it prints, as a user would), the survivors finish the 4 epochs on 2 ranks with a test
accuracy far above chance."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from support import ROOT, has_ulfm, job_env, mpirun_command

pytestmark = [pytest.mark.skipif(not has_ulfm(), reason="needs Open MPI with ULFM"),
              pytest.mark.timeout(200)]


def test_train_digits_elastic_survives_a_killed_rank():
    cmd = mpirun_command(3, ["--with-ft", "ulfm", sys.executable,
                             str(ROOT / "examples" / "pytorch" / "train_digits_elastic.py"),
                             "--epochs", "4"])
    proc = subprocess.Popen(cmd, env=job_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    watchdog = threading.Timer(150, proc.kill)  # a hang fails the test instead of blocking it
    watchdog.start()
    lines: list[str] = []
    pids: dict[int, int] = {}
    killed = False
    try:
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("rank ") and ": pid " in line:
                rank, pid = line.split(": pid ")
                pids[int(rank.split()[1])] = int(pid)
            if line.startswith("epoch 2:") and not killed:  # printed again after a reset
                os.kill(pids[1], signal.SIGKILL)
                killed = True
        err = proc.stderr.read()
        proc.wait()
    finally:
        watchdog.cancel()
    out = "".join(lines)
    report = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
    assert proc.returncode == 0, report
    assert "reset: now 2 rank(s)" in out, report
    final = [line.split() for line in lines if line.startswith("final:")]
    assert final and final[0][4:] == ["on", "2", "rank(s)"], report
    assert float(final[0][3]) > 0.85, report  # chance is 0.1
