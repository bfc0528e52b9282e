#!/usr/bin/env python3
"""Gradient compression measured as time to accuracy, every compressor in one run.

Trains the same model from the same initial weights on the same data with each compressor in
turn (none, fp16, PowerSGD at ranks 1, 4 and 16, 1-bit, top-k), all inside ONE job, and prints
per compressor: the payload each rank sends per step, the median step time, the time (and
epoch) at which the test accuracy first reached the target, and the final accuracy.  Three
models on scikit-learn's digits (offline, 8x8 images): a wide MLP (1.1 M parameters), a CNN
(two 3x3 convolutions and a wide dense layer, 1.1 M parameters; PowerSGD sees the conv
kernels as out x in*3*3 matrices, as torch's hook does) and a small transformer over the
image's 8 rows as tokens (0.6 M parameters at width 128); all sized so that on a slow link the
gradient exchange, not the compute, sets the pace.

The per-rank batch is 8 by default: the regime compression is for, where adding ranks shrinks
each rank's share of a fixed global batch until the exchange dominates the step.  Four ranks
share two cores here, so their compute is slower than real hosts'; with 32 per rank (the
default until 2026-11-27) the CNN's and the transformer's steps were mostly compute, and no
compressor could halve them (README, "Gradient compression").

By default the job runs on a namespace cluster (tools/netns_cluster.py, 2 hosts x 2 ranks)
whose links ``tc tbf`` shapes to 1 Gbit/s, as root from a checkout with its .venv::

    .venv/bin/python benchmarks/compression_training.py                  # 2x2, 1 Gbit/s
    .venv/bin/python benchmarks/compression_training.py --rate 10gbit --models mlp
    .venv/bin/python benchmarks/compression_training.py --local -np 2    # plain mpirun here

"payload/step" is what one rank hands the network per step: for an allreduce (none, fp16,
PowerSGD) its tensors' bytes (a ring moves about twice that per rank), for an allgather
(1-bit, top-k) its own compressed bytes (it receives that from every other rank).  PowerSGD
averages uncompressed for its first ``--powersgd-start`` steps (torch's warm-up), which the
payload column includes.  Compressors are taken in turn, so drift on this shared machine does
not hit one alone; the load average is printed with the table.

On digits the test set is 360 images, so the epoch at which a run first crosses a target moves
by several epochs with the seed (one image is 0.28 points).  ``--seeds N`` trains every
compressor from N seeds (initial weights and data order) and reports medians over them: time
to target (a seed that never reaches it counts as infinitely slow), step time, and the mean
and range of the final accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("none", "fp16", "powersgd1", "powersgd4", "powersgd16", "onebit", "topk")
MODELS = ("mlp", "cnn", "transformer")


# ------------------------------------------------------------------------------ the job
def _models(transformer_width: int = 128) -> dict[str, Any]:
    import torch
    from torch import nn

    class RowTransformer(nn.Module):
        """The 8 rows of a digit as 8 tokens of 8 pixels; mean-pooled, then classified."""

        def __init__(self, width: int = 128, layers: int = 3) -> None:
            super().__init__()
            self.embed = nn.Linear(8, width)
            self.position = nn.Parameter(torch.zeros(8, width))
            layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width,
                                               dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(width, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = self.embed(x.view(-1, 8, 8)) + self.position
            return self.head(self.encoder(tokens).mean(dim=1))

    return {
        "mlp": lambda: nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                     nn.ReLU(), nn.Linear(1024, 10)),
        "cnn": lambda: nn.Sequential(nn.Unflatten(1, (1, 8, 8)),
                                     nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(128 * 8 * 8, 128), nn.ReLU(),
                                     nn.Linear(128, 10)),
        "transformer": lambda: RowTransformer(width=transformer_width),
    }


def _compressor(hvd: Any, name: str, start: int) -> Any:
    if name == "none":
        return hvd.Compression.none
    if name == "fp16":
        return hvd.Compression.fp16
    if name.startswith("powersgd"):
        return hvd.Compression.powersgd(rank=int(name[len("powersgd"):]), start_iter=start)
    if name == "onebit":
        return hvd.Compression.onebit()
    if name == "topk":
        return hvd.Compression.topk(ratio=0.01)
    raise ValueError(f"unknown compressor {name!r}; choose from {CONTENDERS}")


def _train(hvd: Any, model_name: str, compressor_name: str, args: argparse.Namespace,
           data: tuple[Any, Any, Any, Any], seed: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = _models(args.transformer_width)[model_name]()
    numel = sum(p.numel() for p in model.parameters())
    compression = _compressor(hvd, compressor_name, args.powersgd_start)
    base = (torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
            if model_name != "transformer"
            else torch.optim.Adam(model.parameters(), lr=args.lr / 100))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rank, size = hvd.rank(), hvd.size()
    per_rank = args.batch_size
    steps_per_epoch = len(x_train) // (per_rank * size)
    step_times: list[float] = []
    reached: tuple[int, float] | None = None
    accuracy = 0.0
    elapsed = 0.0
    curve: list[list[float]] = []  # [training seconds, test accuracy] after each epoch
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train),
                               generator=torch.Generator().manual_seed(1000 * seed + epoch))
        model.train()
        for step in range(steps_per_epoch):
            at = (step * size + rank) * per_rank
            idx = order[at:at + per_rank]
            hvd.barrier()  # every step starts together: step time is the slowest rank's
            start = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
            took = time.perf_counter() - start
            step_times.append(took)
            elapsed += took
        model.eval()
        with torch.no_grad():
            correct = (model(x_test).argmax(1) == y_test).float().mean().item()
        # Every rank holds the same model; the slowest rank's clock decides.
        elapsed = float(hvd.allreduce(torch.tensor([elapsed]), op=hvd.Max,
                                      name=f"clock.{model_name}.{compressor_name}.{seed}.{epoch}"))
        accuracy = correct
        curve.append([elapsed, accuracy])
        if reached is None and accuracy >= args.target[model_name]:
            reached = (epoch, elapsed)
    steps = len(step_times)
    wire = getattr(compression, "wire_bytes", None)
    if wire is None:  # a stateless compressor: every gradient, whole, at its wire width
        itemsize = 2 if compressor_name == "fp16" else 4
        payload = numel * itemsize
    else:
        payload = wire / steps
    return {"model": model_name, "compressor": compressor_name, "seed": seed,
            "parameters": numel,
            "payload_bytes": payload, "step_ms": 1e3 * statistics.median(step_times),
            "epoch_to_target": reached[0] if reached else None,
            "seconds_to_target": reached[1] if reached else None,
            "train_seconds": elapsed, "final_accuracy": accuracy, "steps": steps,
            "target": args.target[model_name], "curve": curve}


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import mpitrain.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, digits.target, test_size=0.2,
                                              random_state=0, stratify=digits.target)
    data = (torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te),
            torch.from_numpy(y_te))
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        for model_name in args.models:
            for name in args.compressors:
                row = _train(hvd, model_name, name, args, data, seed)
                rows.append(row)
                if hvd.rank() == 0:
                    print(f"seed {seed} {model_name:12s} {name:11s} acc "
                          f"{row['final_accuracy']:.4f} step {row['step_ms']:.1f} ms",
                          file=sys.stderr, flush=True)
    if hvd.rank() == 0:
        print("BENCH " + json.dumps({"rows": rows, "size": hvd.size(),
                                     "load": os.getloadavg()}), flush=True)
    hvd.shutdown()
    return 0


# ----------------------------------------------------------------------------- the table
def _median_time(runs: list[dict[str, Any]]) -> float | None:
    """Median seconds to target over seeds; a seed that never got there counts as infinite."""
    times = [r["seconds_to_target"] if r["seconds_to_target"] is not None else float("inf")
             for r in runs]
    middle = statistics.median(times)
    return None if middle == float("inf") else middle


def report(data: dict[str, Any], link: str, target: dict[str, float]) -> str:
    seeds = sorted({r.get("seed", 0) for r in data["rows"]})
    lines = [f"## Time to accuracy by compressor: {data['size']} ranks, {link} "
             f"(load average {data['load'][0]:.2f} at the end)"
             + (f"; medians over {len(seeds)} seeds" if len(seeds) > 1 else ""), ""]
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        runs: dict[str, list[dict[str, Any]]] = {}
        for r in data["rows"]:
            if r["model"] == model:
                runs.setdefault(r["compressor"], []).append(r)
        first = next(iter(runs.values()))[0]
        plain = _median_time(runs["none"]) if "none" in runs else None
        lines += [f"### {model} ({first['parameters'] / 1e6:.2f} M parameters), target "
                  f"accuracy {target[model]:.2f}", "",
                  "| compressor | payload/step | step (median) | to target | reached | epoch | "
                  "time vs none | final accuracy |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, group in runs.items():
            secs = _median_time(group)
            ratio = f"{secs / plain:.2f}x" if secs and plain else "-"
            reached = [r for r in group if r["epoch_to_target"] is not None]
            epochs = statistics.median(r["epoch_to_target"] for r in reached) if reached else None
            finals = [100 * r["final_accuracy"] for r in group]
            final = (f"{statistics.mean(finals):.2f}%" if len(finals) == 1 else
                     f"{statistics.mean(finals):.2f}% ({min(finals):.2f}-{max(finals):.2f})")
            lines.append(
                f"| {name} | {statistics.mean(r['payload_bytes'] for r in group) / 1e6:.3f} MB | "
                f"{statistics.median(r['step_ms'] for r in group):.1f} ms | "
                f"{f'{secs:.1f} s' if secs is not None else 'not reached'} | "
                f"{len(reached)}/{len(group)} | {f'{epochs:g}' if epochs else '-'} | {ratio} | "
                f"{final} |")
        lines += ["", *_goal_lines(runs), ""]
    return "\n".join(lines)


def _goal_lines(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Issue 17's goal for each PowerSGD rank: the uncompressed final accuracy (within 0.5
    points, means over seeds) in at most half of none's time to target, and sooner than fp16."""
    plain = _median_time(runs["none"]) if "none" in runs else None
    if plain is None:
        return []
    fp16 = _median_time(runs["fp16"]) if "fp16" in runs else None
    plain_final = statistics.mean(100 * r["final_accuracy"] for r in runs["none"])
    lines = []
    for name, group in runs.items():
        if not name.startswith("powersgd"):
            continue
        secs = _median_time(group)
        final = statistics.mean(100 * r["final_accuracy"] for r in group)
        if secs is None:
            lines.append(f"- {name}: target not reached: goal not met")
            continue
        checks = [(secs <= 0.5 * plain, f"{secs / plain:.2f}x none's time (goal <= 0.50x)"),
                  (final >= plain_final - 0.5,
                   f"final accuracy {final - plain_final:+.2f} points vs none (goal >= -0.50)")]
        if fp16 is not None:
            checks.append((secs < fp16, f"{secs / fp16:.2f}x fp16's time (goal < 1)"))
        met = all(ok for ok, _ in checks)
        lines.append(f"- {name}: " + ", ".join(text for _, text in checks)
                     + (": **goal met**" if met else ": goal not met"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--compressors", nargs="+", choices=CONTENDERS,
                        default=list(CONTENDERS))
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="per rank (8: a global batch of 32 on 4 ranks; small enough "
                             "that the exchange, not the compute, sets the pace)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="SGD's for the MLP and the CNN; Adam gets a hundredth of it")
    parser.add_argument("--powersgd-start", type=int, default=10,
                        help="PowerSGD's uncompressed warm-up steps (start_iter)")
    parser.add_argument("--transformer-width", type=int, default=128,
                        help="the transformer's model width (4 heads, feed-forward 4x)")
    parser.add_argument("--target-mlp", type=float, default=0.97)
    parser.add_argument("--target-cnn", type=float, default=0.97)
    parser.add_argument("--target-transformer", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per compressor (the table reports medians over them)")
    parser.add_argument("--local", action="store_true",
                        help="run with plain mpirun on this machine, no namespaces")
    parser.add_argument("-np", type=int, default=4, help="ranks with --local")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of every host's link")
    parser.add_argument("--no-shape", action="store_true", help="leave the links unshaped")
    parser.add_argument("--name", default="mtcomp", help="namespace cluster name")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.target = {"mlp": args.target_mlp, "cnn": args.target_cnn,
                   "transformer": args.target_transformer}
    if args.worker:
        return worker(args)

    command = [sys.executable, str(Path(__file__).resolve()), "--worker",
               "--models", *args.models, "--compressors", *args.compressors,
               "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
               "--lr", str(args.lr), "--powersgd-start", str(args.powersgd_start),
               "--target-mlp", str(args.target_mlp), "--target-cnn", str(args.target_cnn),
               "--target-transformer", str(args.target_transformer),
               "--transformer-width", str(args.transformer_width), "--seed", str(args.seed),
               "--seeds", str(args.seeds)]
    sys.path.insert(0, str(ROOT / "tools"))
    from netns_cluster import Cluster, launch_env, missing_requirements

    if args.local:
        mpirun = Path(sys.executable).parent / "mpirun"
        argv_job = [str(mpirun), "--oversubscribe", "--bind-to", "none", "-np", str(args.np),
                    *(["--allow-run-as-root"] if os.geteuid() == 0 else []), *command]
        result = subprocess.run(argv_job, env=launch_env(), capture_output=True, text=True,
                                timeout=7200)
        link = "one machine (shared memory)"
    else:
        reason = missing_requirements()
        if reason:
            print(f"compression_training: cannot build the cluster: {reason} (or use --local)",
                  file=sys.stderr)
            return 2
        with Cluster(args.name, args.hosts, args.slots) as cluster:
            if not args.no_shape:
                cluster.shape(args.rate)
            result = subprocess.run(cluster.launch_argv(args.hosts * args.slots, command),
                                    env=launch_env(), capture_output=True, text=True,
                                    timeout=7200)
        link = (f"{args.hosts} hosts x {args.slots} ranks, "
                f"{'unshaped veth' if args.no_shape else f'tbf {args.rate} links'}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-4000:] + result.stderr[-4000:], file=sys.stderr)
        return result.returncode or 1
    data = json.loads(lines[-1][len("BENCH "):])
    if args.json:
        Path(args.json).write_text(json.dumps({"link": link, **data}, indent=1))
    print(report(data, link, args.target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
