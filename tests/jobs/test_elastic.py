"""Elastic training with ULFM: ranks SIGKILLed mid-training, survivors finish in place.

Each case runs tests/jobs/elastic_train.py under ``mpirun --with-ft ulfm`` with an exit
schedule (original rank -> [epoch, batch] at which it kills itself) and checks, from the
per-rank JSON logs: the world sizes every survivor saw after each reset, the number of resets,
identical final parameters on all survivors, a finite final loss, and that over every epoch
the committed batches of all ranks (the dead ones' until they died) cover the dataset with no
sample skipped, and none repeated beyond the padding of the epoch's last round.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import is_open_mpi, mpirun, run_job

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).with_name("elastic_train.py")
SAMPLES, EPOCHS = 96, 3  # as in elastic_train.py


def _has_ulfm() -> bool:
    if not is_open_mpi(mpirun()):
        return False
    info = Path(mpirun()).with_name("ompi_info")
    try:
        out = subprocess.run([str(info)], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "FT MPI support: yes" in out


CASES = [
    # np, schedule, sizes every survivor sees
    pytest.param(3, {"1": [0, 3, "backward"]}, [3, 2], id="np3-one-killed-in-backward"),
    # Rank 0 dies, rank 2 dies inside the rebuild that follows, rank 3 in the next epoch:
    # rank 1 finishes alone.
    pytest.param(4, {"0": [0, 2], "2": "rebuild", "3": [1, 1]}, [4, 2, 1],
                 id="np4-three-killed-one-in-a-rebuild"),
]


@pytest.mark.skipif(not _has_ulfm(), reason="needs Open MPI with ULFM (FT MPI support)")
@pytest.mark.parametrize(("np_", "schedule", "sizes"), CASES)
def test_survivors_finish_the_training(tmp_path, np_, schedule, sizes):
    proc = run_job(np_, ["--with-ft", "ulfm", sys.executable, str(SCRIPT), str(tmp_path),
                         json.dumps(schedule)], timeout=120)
    output = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, output
    logs = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(logs) == list(range(np_)), output
    dead = {int(r) for r in schedule}
    survivors = [logs[r] for r in range(np_) if r not in dead]
    for log in survivors:
        assert log["sizes"] == sizes, (log["rank"], log["sizes"])
        assert log["resets"] == len(sizes) - 1
        assert log["final_size"] == sizes[-1]
        assert math.isfinite(log["final_loss"])
    assert len({log["params"] for log in survivors}) == 1, "survivors' parameters differ"
    assert len({log["final_loss"] for log in survivors}) == 1
    reported = [int(r) for lost in re.findall(r"lost world rank\(s\) \[([\d, ]+)\]", proc.stderr)
                for r in lost.split(",")]
    assert sorted(reported) == sorted(dead), output
    for r in dead:
        assert "params" not in logs[r], f"rank {r} was to die but finished"
    # Recovery: from the first death after the last recovery to the survivors' next committed
    # step (reported; loosely bounded so a loaded CI machine passes; the aim is under 5 s).
    deaths = sorted(logs[r]["died_at"] for r in dead)
    seconds, since = [], 0.0
    for reset in range(len(sizes) - 1):
        recovered = max(log["recovered_at"][reset] for log in survivors)
        seconds.append(round(recovered - min(d for d in deaths if d > since), 3))
        since = recovered
    print(f"recovery times (s): {seconds}")
    assert all(0 < s < 30 for s in seconds), seconds
    for epoch in range(EPOCHS):
        seen = [i for log in logs.values() for e, batch in log["batches"] if e == epoch
                for i in batch]
        assert set(seen) == set(range(SAMPLES)), f"epoch {epoch} skipped samples"
        # Repeats only as padding: fewer than one per rank of the epoch's last round.
        assert len(seen) - SAMPLES < np_, f"epoch {epoch} repeated {len(seen) - SAMPLES}"
