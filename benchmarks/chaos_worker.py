"""One rank of the chaos soak's training job (benchmarks/chaos_soak.py starts it through
``mpitrainrun --host-discovery-script``; run that, not this).

Elastic training of a small CNN on scikit-learn's digits (real images, no download) under
``hvd.elastic.run``, until the soak says stop.  Every process appends what happens to it to
``RUNDIR/workers/HOST-PID.jsonl``: its start, init, each step (rank 0) and commit, every reset
with the step it had reached and the step it restored, and at the end a digest of its
parameters and its last loss.

Faults the soak orders a process to suffer (``RUNDIR/orders/PID``, read at every step; the
soak also kills processes itself at random moments):

* ``collective``: SIGKILL from a timer 0-50 ms into the next step, so inside its forward,
  backward or gradient allreduce;
* ``commit``: SIGKILL from a timer 0-2 ms into the next commit (its copy of the state, the
  hosts check's broadcast);
* ``init``: SIGKILL inside the next rebuild, right after the survivors' shrink (the soak then
  kills another rank to start one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import mpitrain as hvd
from mpitrain.core import survivors

BATCH = 32
COMMIT_EVERY = 5  # steps between commits (a failure loses at most these)
LR = 0.02


class Log:
    """This process's events, one JSON line each, flushed as written."""

    def __init__(self, rundir: Path) -> None:
        (rundir / "workers").mkdir(parents=True, exist_ok=True)
        self.path = rundir / "workers" / f"{socket.gethostname()}-{os.getpid()}.jsonl"
        self.file = open(self.path, "a", buffering=1)  # noqa: SIM115 - for the process's life

    def __call__(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"t": time.time(), "event": event, "pid": os.getpid(),
                                    "host": socket.gethostname(), **fields}) + "\n")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rundir", type=Path)
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds to sleep per step (keeps a soak's CPU use modest)")
    args = parser.parse_args()
    log = Log(args.rundir)
    orders = args.rundir / "orders"
    stop = args.rundir / "stop"
    log("start")
    hvd.init()
    log("init", rank=hvd.rank(), size=hvd.size())
    torch.manual_seed(0)
    torch.set_num_threads(1)
    digits = load_digits()
    images = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    train = torch.utils.data.TensorDataset(images, torch.from_numpy(digits.target))
    model = cnn()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer,
                                   sampler=hvd.elastic.ElasticSampler(train, seed=0),
                                   epoch=0, batch=0, step=0)
    armed = {"commit": False, "reached": 0}

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = LR * hvd.size()
        log("reset", rank=hvd.rank(), size=hvd.size(), reached=armed["reached"],
            restored=state.step)

    state.register_reset_callbacks([on_reset])

    def take_order() -> None:
        mine = orders / str(os.getpid())
        if not mine.exists():
            return
        where = mine.read_text().strip()
        mine.unlink()
        log("order", where=where, step=state.step)
        if where == "collective":
            threading.Timer(random.uniform(0, 0.05), die).start()
        elif where == "commit":
            armed["commit"] = True
        elif where == "init":
            shrink = survivors.shrink

            def shrink_then_die(comm: Any) -> Any:
                shrink(comm)
                log("dying", where="init")
                die()

            survivors.shrink = shrink_then_die

    @hvd.elastic.run
    def train_loop(state: hvd.elastic.TorchState) -> None:
        while True:
            loader = torch.utils.data.DataLoader(train, batch_size=BATCH, sampler=state.sampler)
            for x, y in loader:
                take_order()
                started = time.time()
                armed["reached"] = state.step + 1
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, BATCH)
                state.batch += 1
                state.step += 1
                if hvd.rank() == 0:
                    log("step", step=state.step, seconds=time.time() - started,
                        loss=loss.item(), size=hvd.size())
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if state.step % COMMIT_EVERY:
                    continue
                if armed["commit"]:
                    threading.Timer(random.uniform(0, 0.002), die).start()
                state.commit()
                log("commit", step=state.step, rank=hvd.rank(), size=hvd.size(),
                    loss=loss.item())
                # Stop when the soak says so, at the same step everywhere (rank 0 decides).
                if hvd.broadcast_object(stop.exists(), root_rank=0, name="soak.stop"):
                    return
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train_loop(state)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    log("done", rank=hvd.rank(), size=hvd.size(), step=state.step,
        params=hashlib.sha256(flat.numpy().tobytes()).hexdigest())


if __name__ == "__main__":
    main()
