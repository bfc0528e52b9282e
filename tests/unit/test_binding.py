import os

from mpitrain.core import binding


def test_thread_share_divides_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert binding.cpu_threads_for(4) == 2
    assert binding.cpu_threads_for(16) == 1


def test_thread_share_respects_launcher_binding(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert binding.cpu_threads_for(2) == 3


def test_user_thread_choice_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert binding.set_cpu_threads(2) is None


def test_no_gpu_means_no_binding():
    if binding.cuda_device_count() == 0:
        assert binding.bind_device(0) is None
