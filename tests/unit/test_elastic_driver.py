"""mpitrainrun's elastic driver without MPI: discovery output, the blacklist and its cooldown,
placement, failed ranks read from launchers' reports, and the driver loop with fake jobs."""

from __future__ import annotations

import io
import subprocess

import pytest

from mpitrain.core import elastic_control
from mpitrain.runner.discovery import (
    Blacklist,
    DiscoveryError,
    order_hosts,
    parse_discovery_output,
    place,
)
from mpitrain.runner.elastic_driver import (
    DriverOptions,
    ElasticDriver,
    failed_ranks,
    host_of_rank,
)
from mpitrain.runner.hosts import HostSlots


def test_discovery_output_is_horovods_format():
    text = "node1:4\n# spare\nnode2\n\n  node3:2  # comment\n"
    assert parse_discovery_output(text, default_slots=3) == {"node1": 4, "node2": 3, "node3": 2}


@pytest.mark.parametrize(("text", "message"), [
    ("node1:x", "line 1: 'node1:x' is not 'host' or 'host:slots'"),
    ("ok\nbad host", "line 2: 'bad host'"),
    ("node1:0", "has 0 slots; give at least 1"),
])
def test_malformed_discovery_output_names_the_line(text, message):
    with pytest.raises(DiscoveryError, match=message):
        parse_discovery_output(text, 1, "d.sh")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_without_a_cooldown_a_host_is_blacklisted_for_good():
    clock = Clock()
    blacklist = Blacklist(None, clock)
    assert blacklist.add("a") is None
    clock.now += 1e9
    assert blacklist.blocks("a") and not blacklist.blocks("b")
    assert blacklist.blocked() == ["a"]


def test_the_cooldown_starts_at_the_lower_bound_doubles_and_stops_at_the_upper():
    clock = Clock()
    blacklist = Blacklist((10.0, 35.0), clock, jitter=lambda: 0.0)
    assert [blacklist.add("a") for _ in range(4)] == [10.0, 20.0, 35.0, 35.0]
    assert blacklist.blocks("a")
    clock.now += 35.0
    assert not blacklist.blocks("a") and blacklist.blocked() == []
    jittered = Blacklist((10.0, 100.0), clock, jitter=lambda: 0.5)
    assert jittered.add("b") == 15.0


def test_hosts_keep_their_order_and_new_ones_come_last():
    assert order_hosts(["c", "a", "d"], ["a", "b", "c"]) == ["a", "c", "d"]
    assert place({"a": 2, "c": 4, "d": 1}, ["a", "c", "d"], 5) == [HostSlots("a", 2),
                                                                    HostSlots("c", 3)]
    assert place({"a": 2}, ["a"], 5) == [HostSlots("a", 2)]


def test_failed_ranks_are_read_from_open_mpis_and_mpichs_reports():
    open_mpi_signal = ("prterun noticed that process rank 3 with PID 1234 on node n2 exited on\n"
                       "signal 9 (Killed).")
    open_mpi_status = ("The first process to do so was:\n\n  Process name: [prterun-n1-99@1,5]\n"
                       "  Exit code:    1")
    mpich = "=   RANK 2 PID 77 RUNNING AT n2\n=   KILLED BY SIGNAL: 9 (Killed)"
    assert failed_ranks(open_mpi_signal) == [3]
    assert failed_ranks(open_mpi_status) == [5]
    assert failed_ranks(mpich + "\n" + open_mpi_signal) == [3, 2]
    layout = [HostSlots("n1", 2), HostSlots("n2", 2)]
    assert [host_of_rank(layout, r) for r in (0, 1, 2, 3, 4)] == ["n1", "n1", "n2", "n2", None]


class FakeJob:
    """A launched job: runs for ``polls`` waits, records ``events`` (as its rank 0 would)
    after the first, then ends with ``code``; ``on_notice`` reacts to the driver's notice."""

    def __init__(self, argv, control_dir, code=0, polls=2, events=(), stderr="",
                 stop_on_notice=False):
        self.argv, self.control_dir, self.code, self.polls = argv, control_dir, code, polls
        self.events, self.stop_on_notice = list(events), stop_on_notice
        self.stderr = io.StringIO(stderr)
        self.returncode = None

    def wait(self, timeout=None):
        for event in self.events:
            elastic_control.append_event(self.control_dir, event.pop("event"), **event)
        self.events = []
        if self.stop_on_notice and elastic_control.read_notice(self.control_dir):
            elastic_control.append_event(self.control_dir, "stopping", reason="hosts updated")
            self.polls = 0
        self.polls -= 1
        if self.polls < 0:
            self.returncode = self.code
            return self.code
        raise subprocess.TimeoutExpired("job", timeout)

    def send_signal(self, signum):
        pass


def make_driver(tmp_path, hosts_seq, jobs, **options):
    clock = Clock()
    seq = iter(hosts_seq)
    last = {}

    def discover():
        nonlocal last
        last = next(seq, last)
        if isinstance(last, Exception):
            raise last
        return dict(last)

    launched = []

    def popen(argv, **kwargs):
        job = jobs[len(launched)](argv)
        launched.append(job)
        return job

    defaults = dict(np=4, min_np=1, max_np=4, restarts=3, elastic_timeout_s=10.0,
                    interval_s=1.0, control_dir=str(tmp_path / "ctl"),
                    state_file=str(tmp_path / "state.pkl"), keep_state_file=False)
    defaults.update(options)
    lines = []
    driver = ElasticDriver(DriverOptions(**defaults), discover,
                           Blacklist(None, clock), lambda layout: [str(layout)],
                           log=lines.append, popen=popen, clock=clock, sleep=clock.sleep)
    return driver, lines, launched


def test_a_failed_rank_blacklists_its_host_and_the_job_restarts_on_the_others(tmp_path):
    ctl = str(tmp_path / "ctl")
    report = "prterun noticed that process rank 2 with PID 9 on node b exited on signal 9"
    driver, lines, launched = make_driver(
        tmp_path, [{"a": 2, "b": 2}],
        [lambda argv: FakeJob(argv, ctl, code=137, stderr=report),
         lambda argv: FakeJob(argv, ctl, code=0)])
    assert driver.run() == 0
    assert driver.launches == [[HostSlots("a", 2), HostSlots("b", 2)], [HostSlots("a", 2)]]
    assert "blacklisting host b (a rank failed there)" in lines
    assert any("restarting it from the start (no commit was written) (1 of 3)" in line
               for line in lines)
    assert not (tmp_path / "ctl").exists()


def test_in_place_losses_are_blacklisted_and_new_hosts_grow_the_job_at_a_commit(tmp_path):
    ctl = str(tmp_path / "ctl")
    hosts = [{"a": 2, "b": 2}, {"a": 2, "b": 2}, {"a": 2, "b": 2, "c": 2}]
    driver, lines, launched = make_driver(
        tmp_path, hosts,
        [lambda argv: FakeJob(argv, ctl, polls=5, stop_on_notice=True,
                              events=[{"event": "lost", "ranks": [3], "hosts": ["x"]}]),
         lambda argv: FakeJob(argv, ctl)])
    assert driver.run() == 0
    # Rank 3 (host b) lost in place: b blacklisted, so only c's slots make the job grow.
    assert "blacklisting host b (a rank failed there)" in lines
    assert "the job lost world rank(s) [3] on host(s) ['b']; it continues in place on ? " \
           "rank(s)" in lines
    assert any("4 rank(s) could run where 3 do" in line for line in lines), lines
    assert "the job stopped at a commit to use the new hosts; restarting it there" in lines
    assert driver.launches[1] == [HostSlots("a", 2), HostSlots("c", 2)]


def test_a_host_leaving_the_list_stops_the_job_at_a_commit(tmp_path):
    ctl = str(tmp_path / "ctl")
    driver, lines, _ = make_driver(
        tmp_path, [{"a": 2, "b": 2}, {"a": 2, "b": 2}, {"a": 2}],
        [lambda argv: FakeJob(argv, ctl, polls=5, stop_on_notice=True),
         lambda argv: FakeJob(argv, ctl)])
    assert driver.run() == 0
    assert any("host(s) ['b'] left the list" in line for line in lines), lines
    assert driver.launches[1] == [HostSlots("a", 2)]


def test_too_few_slots_for_min_np_waits_then_gives_up_with_the_reason(tmp_path):
    driver, lines, launched = make_driver(tmp_path, [{"a": 1}], [], min_np=2,
                                          elastic_timeout_s=5.0)
    assert driver.run() == 1 and launched == []
    assert "waiting for --min-np 2 slots (1 available now)" in lines
    assert any("fewer than --min-np 2, for 5 s; giving up" in line for line in lines)


def test_restarts_stop_at_the_reset_limit(tmp_path):
    ctl = str(tmp_path / "ctl")
    driver, lines, launched = make_driver(
        tmp_path, [{"a": 4}], [lambda argv: FakeJob(argv, ctl, code=1)] * 3, restarts=2)
    assert driver.run() == 1 and len(launched) == 3
    assert any("restarted 2 time(s), the --reset-limit; giving up" in line for line in lines)


def test_a_discovery_script_failing_mid_job_keeps_the_hosts(tmp_path):
    ctl = str(tmp_path / "ctl")
    driver, lines, _ = make_driver(
        tmp_path, [{"a": 2}, DiscoveryError("host discovery 'd' exited with status 1: x")],
        [lambda argv: FakeJob(argv, ctl, polls=2)], np=2, max_np=2)
    assert driver.run() == 0
    assert any("warning: host discovery 'd' exited with status 1" in line for line in lines)
