"""Say where this rank is (as the launcher and mpitrain see it), then train the digits
example in this same process: one job start checks the layout and the training's bits.

    python tests/jobs/rdzv_digits.py [train_digits.py's options]
"""

import json
import os
import runpy
import socket
import sys
from pathlib import Path

import mpitrain as hvd

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "pytorch" / "train_digits.py"

hvd.init()  # the example's own init() then does nothing
print("LAYOUT " + json.dumps({
    "rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(),
    "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "launcher_local_rank": os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"),
    # The rendezvous's secret stays with the agents.
    "secret_seen": "MPITRAIN_RDZV_SECRET" in os.environ}), flush=True)
sys.argv = [str(DIGITS), *sys.argv[1:]]
runpy.run_path(str(DIGITS), run_name="__main__")
