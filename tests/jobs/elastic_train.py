"""An elastic training job for tests/jobs/test_elastic.py: a small regression trained under
``hvd.elastic.run``, with an exit schedule, writing one JSON log per (original) rank.

    mpirun --with-ft ulfm -np 3 python elastic_train.py LOGDIR '{"1": [0, 3]}'

The schedule maps an original rank to ``[epoch, batch]``: that rank SIGKILLs itself (once per
job, also when the job is restarted) before
that batch's forward pass (so every rank has committed the batch before it); with
``[epoch, batch, "backward"]`` it dies when its first layer's gradient is computed, the last
of the backward pass, while the other gradients are in flight; with ``[epoch, batch, "host"]``
it kills every process of its network namespace, Open MPI's daemon included (a host of
tools/netns_cluster.py dying); with ``[epoch, batch, "exit"]``
it leaves with ``os._exit(3)`` (no MPI_Finalize: Open MPI's runtime does not tell the others,
only ULFM's heartbeat detector finds it); with ``"rebuild"`` it dies in
the first rebuild, right after the survivors' shrink (a manual probe: the survivors recover,
but Open MPI 5.0.11's MPI_Finalize then sometimes hangs, see test_elastic.py).  Every rank logs,
after each commit, the batch's sample indices; a dying rank its time of death; a survivor
the time its first step after each reset was committed (recovery = that minus the death);
and at the end the sizes it saw after each reset, its resets and a digest of the final
parameters.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import os
import signal
import sys
import time

import torch
from mpi4py import MPI

import mpitrain.torch as hvd
from mpitrain.core import survivors

EPOCHS, BATCH, SAMPLES, FEATURES = 3, 4, 96, 8


def main() -> None:
    # A hang prints every thread's stack and ends this rank, well before the test's timeout.
    faulthandler.dump_traceback_later(float(os.environ.get("ELASTIC_TRAIN_HANG_S", "60")),
                                      exit=True)
    logdir, schedule = sys.argv[1], json.loads(sys.argv[2])
    # Optional: {"hosts_file": F, "hosts": TEXT, "at": [epoch, batch]}: rank 0 writes TEXT to
    # F (what the test's discovery script prints) when it reaches that batch, once per job.
    grow = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    original = MPI.COMM_WORLD.Get_rank()
    die_at = schedule.get(str(original))
    log: dict = {"rank": original, "batches": [], "resets": 0, "sizes": [], "recovered_at": [],
                 "launches": 0, "netns": os.readlink("/proc/self/ns/net")}
    path = os.path.join(logdir, f"rank{original}.json")
    if grow is not None and os.path.exists(path):
        with open(path) as f:  # restarted on new hosts: one log across the launches
            log = json.load(f)
    log["launches"] += 1

    def write_log() -> None:
        with open(path + ".tmp", "w") as f:
            json.dump(log, f)
        os.replace(path + ".tmp", path)

    hvd.init()
    log["sizes"].append(hvd.size())
    torch.manual_seed(0)
    data = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(1))
    target = data @ torch.arange(FEATURES, dtype=torch.float32) + 0.5
    dataset = torch.utils.data.TensorDataset(data, target, torch.arange(SAMPLES))
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    # A rank dies once per job: a job restarted from its last commit (mpitrainrun
    # --elastic-restart) runs the same schedule again, and this marker keeps it alive then.
    marker = os.path.join(logdir, f"died{original}")
    if os.path.exists(marker):
        die_at = None

    def die(exit_status: int | None = None) -> None:
        """SIGKILL, or with ``exit_status`` a hard exit (no atexit, no MPI_Finalize)."""
        log["died_at"] = time.time()  # wall clock: compared with the survivors' on this machine
        write_log()
        open(marker, "w").close()
        if exit_status is not None:
            os._exit(exit_status)
        os.kill(os.getpid(), signal.SIGKILL)

    def wait_for_host_peers_logs(netns: str) -> None:
        """Let the ranks of this host finish logging the batches every rank has committed.

        The host is killed right after the commit of the batch before: a peer on it may have
        committed that batch (its samples count as trained) but not yet logged them, and then
        the test's evidence, not the training, would miss them.  Bounded: after 10 s the host
        dies anyway and the test reports what is missing."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            behind = False
            for name in os.listdir(logdir):
                if not (name.startswith("rank") and name.endswith(".json")):
                    continue
                try:
                    with open(os.path.join(logdir, name)) as f:
                        peer = json.load(f)
                except (OSError, ValueError):
                    behind = True  # being replaced right now: read it again
                    continue
                logged = sum(1 for e, _ in peer["batches"] if e == state.epoch)
                if peer.get("netns") == netns and logged < state.batch:
                    behind = True
            if not behind:
                return
            time.sleep(0.01)

    def die_with_host() -> None:
        """The whole host dies: every process of this network namespace (a host of the
        namespace cluster, tools/netns_cluster.py), Open MPI's daemon included."""
        if os.environ.get("ELASTIC_TRAIN_NETNS_HOST") != "1":  # never on a real machine
            raise RuntimeError("'host' deaths need ELASTIC_TRAIN_NETNS_HOST=1 (namespace hosts)")
        mine = os.readlink("/proc/self/ns/net")
        wait_for_host_peers_logs(mine)
        log["died_at"] = time.time()
        write_log()
        open(marker, "w").close()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                same = os.readlink(f"/proc/{pid}/ns/net") == mine
            except OSError:
                continue
            if same and int(pid) != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_reset() -> None:
        log["resets"] += 1
        log["sizes"].append(hvd.size())

    state.register_reset_callbacks([on_reset])
    if die_at == "rebuild":
        # Die inside the first rebuild, once the survivors have shrunk: they must notice in
        # their init() and shrink again.
        shrink = survivors.shrink

        def shrink_then_die(comm):
            shrink(comm)
            die()

        survivors.shrink = shrink_then_die

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> float:
        loss = torch.tensor(0.0)
        while state.epoch < EPOCHS:
            loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH,
                                                 sampler=state.sampler)
            for x, y, idx in loader:
                if die_at == [state.epoch, state.batch]:
                    die()
                if die_at == [state.epoch, state.batch, "host"]:
                    die_with_host()
                if die_at == [state.epoch, state.batch, "exit"]:
                    die(exit_status=3)
                if die_at == [state.epoch, state.batch, "backward"]:
                    # Die halfway through the backward pass: the gradients computed so far
                    # are already being reduced by the other ranks' engines.
                    next(model.parameters()).register_hook(lambda grad: die())
                if grow is not None:
                    time.sleep(grow.get("step_s", 0))  # time for the driver to notice
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(state.batch, BATCH)
                state.batch += 1
                if grow is not None and [state.epoch, state.batch] == grow["at"] and \
                        original == 0 and log["launches"] == 1:
                    with open(grow["hosts_file"], "w") as f:
                        f.write(grow["hosts"])
                try:
                    state.commit()
                except hvd.elastic.HostsUpdatedInterrupt:  # committed, then stopping to grow
                    log["batches"].append([state.epoch, idx.tolist()])
                    write_log()
                    raise
                log["batches"].append([state.epoch, idx.tolist()])
                if len(log["recovered_at"]) < log["resets"]:  # first step after a reset
                    log["recovered_at"].append(time.time())
                write_log()
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} done on {hvd.size()} ranks", flush=True)
            # Counters and sampler move to the next epoch in one commit (Horovod's end_epoch).
            state.epoch += 1
            state.batch = 0
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return float(hvd.allreduce(loss.detach(), name="final_loss"))

    log["final_loss"] = train(state)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    log["params"] = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    log["final_size"] = hvd.size()
    write_log()
    hvd.shutdown()


if __name__ == "__main__":
    main()
