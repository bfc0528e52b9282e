"""Hugging Face Trainer under mpirun: every way of setting mpitrain up trains one model.

Before mpitrain exported the job's layout (RANK, WORLD_SIZE, LOCAL_RANK, ...) and made torch's
default process group an mpitrain one, two of these routes trained a separate model per rank
without an error (Trainer saw a world of one).  Now each must report the real world size, end
with identical parameters on every rank, and equal Trainer's own Gloo route on the same seeds.
"""

import re

import pytest

from support import ROOT, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = str(ROOT / "tests" / "jobs" / "hf_trainer_routes.py")
LINE = re.compile(r"RESULT rank=(\d+) world=(\d+) sum=(\S+) sha=(\w+)")


def _train(np_: int, route: str) -> list[tuple[int, int, float, str]]:
    env = {"MASTER_ADDR": "127.0.0.1"} if route == "gloo" else {}  # Trainer's route needs it
    result = run_job(np_, [__import__("sys").executable, SCRIPT, route], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [(int(r), int(w), float(s), h) for r, w, s, h in LINE.findall(result.stdout)]
    assert sorted(r for r, *_ in rows) == list(range(np_)), result.stdout
    return rows


@pytest.fixture(scope="module")
def gloo_reference():
    rows = _train(2, "gloo")
    assert len({h for *_, h in rows}) == 1
    return rows[0][3]


@pytest.mark.timeout(900)
# Every route at two ranks against Gloo's bits, except init_process_group("mpitrain") itself,
# which runs at four ranks (each route ends in the same c10d backend; CI time is short).
@pytest.mark.parametrize(("np_", "route"), [(2, "hvd"), (2, "dropin"), (4, "c10d")])
def test_trainer_sees_the_world_and_trains_one_model(gloo_reference, np_, route):
    rows = _train(np_, route)
    assert {w for _, w, _, _ in rows} == {np_}, "Trainer saw the wrong world size"
    assert len({h for *_, h in rows}) == 1, "replicas diverged"
    if np_ == 2:  # two summands: every order of summation gives Gloo's bits
        assert rows[0][3] == gloo_reference
