"""glibc's malloc keeps what a step frees (core/host_malloc.py): a loop that allocates and
frees the same large arrays every step stops page-faulting them in once it is tuned."""

import os
import platform
import statistics
import subprocess
import sys

import pytest

from mpitrain.core import config, host_malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Two 16 MiB arrays written and freed per "step", something small allocated after them (so
# they are not simply the heap's last chunk): the page faults of each step, as a list.
PROBE = """
import resource, sys
import numpy as np
from mpitrain.core import host_malloc
tuned = host_malloc.keep_freed_memory(int(sys.argv[1]))
counts = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a, b = np.ones(4 << 20, dtype=np.float32), np.ones(4 << 20, dtype=np.float32)
    small = np.ones(1024, dtype=np.float32)
    del a, b
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(tuned, *counts)
"""


def _probe(trim_threshold: int, **env: str) -> tuple[bool, float]:
    clean = {k: v for k, v in os.environ.items()
             if k not in host_malloc._USER_SETTINGS and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, str(trim_threshold)], check=True,
                         capture_output=True, text=True, env={**clean, **env}).stdout.split()
    return out[0] == "True", statistics.median(int(c) for c in out[3:])  # after 2 steps


@glibc
def test_a_tuned_process_reuses_the_pages_a_step_freed():
    tuned_default, faults_default = _probe(0)
    if faults_default < 100:
        pytest.skip(f"this machine's malloc keeps the memory anyway ({faults_default} faults)")
    tuned, faults = _probe(1 << 30)
    assert not tuned_default and tuned
    assert faults <= 16, f"{faults} page faults per step after tuning, {faults_default} before"


@glibc
def test_the_users_own_malloc_settings_are_kept():
    tuned, faults = _probe(1 << 30, MALLOC_TRIM_THRESHOLD_="131072")
    assert not tuned
    tuned, _ = _probe(1 << 30, GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")
    assert not tuned


def test_zero_turns_it_off_and_the_default_keeps_a_gib():
    assert not host_malloc.keep_freed_memory(0)
    assert config.Config().malloc_trim_threshold == 1 << 30
    assert config.load({"MPITRAIN_MALLOC_TRIM_THRESHOLD": "0"}).malloc_trim_threshold == 0
    with pytest.warns(RuntimeWarning, match="MPITRAIN_MALLOC_TRIM_THRESHOLD='-1'"):
        assert config.load({"MPITRAIN_MALLOC_TRIM_THRESHOLD": "-1"}).malloc_trim_threshold == \
            1 << 30
