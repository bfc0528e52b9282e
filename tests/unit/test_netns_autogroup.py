"""tools/netns_cluster.py turns the kernel's autogroup scheduling off while a cluster exists
and puts the old value back when the last one goes (files stand in for /proc and /tmp)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def netns(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("netns_cluster_unit",
                                                  ROOT / "tools" / "netns_cluster.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "netns_cluster_unit", module)
    spec.loader.exec_module(module)
    knob = tmp_path / "sched_autogroup_enabled"
    knob.write_text("1\n")
    monkeypatch.setattr(module, "AUTOGROUP", knob)
    monkeypatch.setattr(module, "STATE_BASE", tmp_path)
    return module


def _cluster_state(base: Path, name: str) -> Path:
    state = base / f"mpitrain-netns-{name}" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"name": name}))
    return state


def test_off_while_clusters_exist_and_restored_after_the_last(netns):
    knob, base = netns.AUTOGROUP, netns.STATE_BASE
    first = _cluster_state(base, "a")
    netns._autogroups_off()
    assert knob.read_text().strip() == "0"
    second = _cluster_state(base, "b")
    netns._autogroups_off()  # a second cluster must not record "0" as the value to restore
    first.unlink()
    netns._autogroups_restore()
    assert knob.read_text().strip() == "0", "restored while cluster b still exists"
    second.unlink()
    netns._autogroups_restore()
    assert knob.read_text().strip() == "1"
    assert not (base / netns._AUTOGROUP_SAVED).exists()


def test_a_kernel_without_autogroups_is_left_alone(netns, tmp_path):
    netns.AUTOGROUP = tmp_path / "missing"
    netns._autogroups_off()
    netns._autogroups_restore()
    assert not (tmp_path / netns._AUTOGROUP_SAVED).exists()
