"""What mpitrain writes about a job is its user's alone: the elastic control directory (0700)
and its files, the timeline, the autotune log and the elastic state file (0600), whatever the
umask.  (Shared-memory segments are checked in a running job: tests/jobs/test_private_memory.py.)
"""

from __future__ import annotations

import os
import stat

import pytest

from mpitrain.core import elastic_control, private
from mpitrain.core.config import Config
from mpitrain.engine.autotune import Autotuner, CoordinateSearch, start_setting
from mpitrain.engine.timeline import Timeline
from mpitrain.face import files


@pytest.fixture(autouse=True)
def permissive_umask():
    """The usual umask (022) would leave new files readable by everyone."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_the_elastic_control_directory_and_its_files_are_private(tmp_path):
    directory = tmp_path / "job.pkl.control"
    elastic_control.reset(str(directory))
    elastic_control.write_notice(str(directory), 12.5, elastic_control.ADDED)
    elastic_control.append_event(str(directory), "roster", hosts={"0": "a"})
    elastic_control.append_event(str(directory), "lost", ranks=[1])
    assert mode(directory) == 0o700
    assert mode(directory / elastic_control.NOTICE) == 0o600
    assert mode(directory / elastic_control.EVENTS) == 0o600
    assert elastic_control.read_notice(str(directory)) == (12.5, elastic_control.ADDED)
    assert [e["event"] for e in elastic_control.read_events(str(directory))] == ["roster", "lost"]


def test_a_control_directory_left_open_by_an_earlier_run_is_made_private(tmp_path):
    directory = tmp_path / "old.control"
    directory.mkdir(mode=0o777)
    os.chmod(directory, 0o777)
    elastic_control.reset(str(directory))
    assert mode(directory) == 0o700


def test_the_timeline_file_and_the_directories_made_for_it_are_private(tmp_path):
    path = tmp_path / "runs" / "today" / "timeline.json"
    timeline = Timeline(enabled_here=True)
    timeline.start(str(path))
    timeline.stop()
    assert mode(path) == 0o600
    assert mode(tmp_path / "runs") == 0o700 and mode(tmp_path / "runs" / "today") == 0o700


def test_an_existing_timeline_file_becomes_private_when_rewritten(tmp_path):
    path = tmp_path / "timeline.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    timeline = Timeline(enabled_here=True)
    timeline.start(str(path))
    timeline.stop()
    assert mode(path) == 0o600 and path.read_text().startswith("[")


def test_the_autotune_log_is_private(tmp_path):
    path = tmp_path / "autotune.csv"
    grid = {"fusion_threshold": (4 << 20, 64 << 20), "cycle_time_ms": (1.0, 5.0),
            "algorithm": ("auto",), "channels": (1,)}
    tuner = Autotuner(CoordinateSearch(start_setting(Config()), grid, 5),
                      warmup_samples=1, steps_per_sample=1, log_path=str(path))
    tuner.close()
    assert mode(path) == 0o600


def test_the_elastic_state_file_is_private(tmp_path):
    path = tmp_path / "state.pkl"
    files.write_atomic(str(path), b"the last commit")
    assert mode(path) == 0o600


def test_existing_directories_are_left_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    private.make_dirs(str(shared / "mine"))
    assert mode(shared) == 0o755 and mode(shared / "mine") == 0o700


def test_open_file_is_for_writing_only(tmp_path):
    with pytest.raises(ValueError, match="for writing, not mode 'r'"):
        private.open_file(str(tmp_path / "x"), "r")
