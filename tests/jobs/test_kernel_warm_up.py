"""A job's first allreduce does not wait for numba to load the CPU kernels.

Loading numba's cached kernels took 0.6-1.7 s on our 2-core machines, and it used to happen
inside the first allreduce of every job (its first training step took ~2 s more than the
next).  The engine now starts the load on a thread of its own at ``init()``, so it overlaps the
script's set-up.  The mechanism is checked, not a time: once that thread is done, the kernels
a float32 and a float16 sum run are loaded although no collective ran yet.
"""

import sys

from support import run_job

SCRIPT = """
import threading
import mpitrain as hvd
from mpitrain.ops.kernels import cpu
hvd.init()
loading = [t for t in threading.enumerate() if t.name == "mpitrain-kernel-warm-up"]
assert loading or cpu._f_combine.signatures, "no kernel load started at init()"
for t in loading:
    t.join(120)
loaded = {str(sig) for sig in cpu._f_combine.signatures}
assert any("float32" in s for s in loaded), loaded
assert cpu._f16_narrow.signatures and cpu._f16_widen.signatures
print(f"LOADED rank={hvd.rank()} before any collective: {len(loaded)} combine signatures",
      flush=True)
hvd.shutdown()
"""


def test_init_loads_the_cpu_kernels_before_the_first_collective():
    result = run_job(2, [sys.executable, "-c", SCRIPT], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("LOADED rank=") == 2, result.stdout
