"""job_env: the job's layout exported for torch.distributed-based libraries, and refused when
something else already claims another one."""

import os

import pytest

from mpitrain.core import job_env


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*job_env.LAYOUT_VARIABLES, "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    # Forget what export() saved to restore: a later withdraw() (another test's shutdown) would
    # otherwise bring this test's values back into the process (WORLD_SIZE=4 made a later
    # in-process job test refuse to start).
    job_env.withdraw()


def test_exports_the_layout_and_cpu_hint(clean_env):
    job_env.export(3, 4, 1, 2, has_gpu=False)
    assert [os.environ[n] for n in job_env.LAYOUT_VARIABLES] == ["3", "4", "1", "2"]
    assert os.environ["ACCELERATE_USE_CPU"] == "true"


def test_no_cpu_hint_with_a_gpu_or_alone(clean_env):
    job_env.export(0, 4, 0, 4, has_gpu=True)
    assert "ACCELERATE_USE_CPU" not in os.environ
    job_env.withdraw()  # not monkeypatch.delenv: its undo would put the exported values back
    job_env.export(0, 1, 0, 1, has_gpu=False)
    assert "ACCELERATE_USE_CPU" not in os.environ


def test_user_choice_of_cpu_hint_wins(clean_env):
    clean_env.setenv("ACCELERATE_USE_CPU", "false")
    job_env.export(0, 2, 0, 2, has_gpu=False)
    assert os.environ["ACCELERATE_USE_CPU"] == "false"


def test_mpi_replaces_other_values_until_withdrawn(clean_env):
    clean_env.setenv("WORLD_SIZE", "4")  # an outer launcher's, or the user's
    clean_env.setenv("RANK", "2")
    job_env.export(0, 1, 0, 1, has_gpu=True)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
    job_env.withdraw()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("2", "4")


def test_torch_world_of_another_size_is_refused():
    dist = pytest.importorskip("torch.distributed")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        job_env.check_torch_world(1)
        with pytest.raises(ValueError, match="world size 1, but MPI runs 2"):
            job_env.check_torch_world(2)
    finally:
        dist.destroy_process_group()


def test_reexport_and_withdraw(clean_env):
    clean_env.setenv("LOCAL_RANK", "0")
    job_env.export(1, 2, 0, 2, has_gpu=False)
    job_env.export(0, 1, 0, 1, has_gpu=False)  # a later init() over a smaller communicator
    assert os.environ["WORLD_SIZE"] == "1"
    job_env.withdraw()
    assert "RANK" not in os.environ and "ACCELERATE_USE_CPU" not in os.environ
    assert os.environ["LOCAL_RANK"] == "0"  # the user's own value comes back
