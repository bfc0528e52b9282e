#!/usr/bin/env python3
"""An alpha-beta-gamma cost model of mpitrain's allreduce algorithms, checked against the
namespace-cluster measurements and extrapolated to 8 .. 1,024 ranks.

Every algorithm is a sequence of steps; a step costs a latency (alpha) plus its bytes over the
bandwidth of the slowest edge it crosses (beta), plus the bytes it reduces over the reduction
throughput (gamma).  With p ranks, l per node, n = p / l nodes and S bytes:

* **ring** (flat, consecutive ranks share a node, so one ring edge per node crosses the
  network): 2(p-1) steps of S/p bytes; a step lasts as long as its network edge,
  ``2(p-1) alpha + 2(p-1)/p S / B + (p-1)/p S / G``;
* **hierarchical** (mpitrain's: reduce-scatter within the node through shared memory, l rings
  of n nodes over S/l bytes each sharing the host's link, allgather within the node):
  ``2 a_local + 2 S / M + (l-1)/l S / G`` inside the node plus
  ``2(n-1) alpha + 2(n-1)/n S / B + (n-1)/n S / (l G)`` across; the phases run one after
  another today;
* **hierarchical, pipelined** (not built yet, issue 16): the three phases overlap chunk by
  chunk, so the slowest phase plus one chunk of the others;
* within one node (n = 1) the shared-memory algorithm: ``a_local + 2 S / M + (l-1)/l S / G``.

The parameters (``--alpha-us`` network latency per message, ``--link-gbit``, ``--local-us``,
``--mem-gbps`` copy bandwidth per rank inside a node, ``--reduce-gbps`` reduction throughput
per rank) default to what this 2-core machine measured (numpy copy and add, below) and the
namespace cluster's shaped links; ``--check`` compares the model with the measured medians in
the ``benchmarks/netns_allreduce.py --json`` files it names (default: every
``benchmarks/results/netns-*.json``).

    .venv/bin/python benchmarks/scale_model.py --check benchmarks/results/netns-*.json
    .venv/bin/python benchmarks/scale_model.py              # 8 .. 1,024 ranks, 10 .. 400 Gbit/s
    .venv/bin/python benchmarks/scale_model.py --gradient-mb 1340 --mem-gbps 200 \\
        --reduce-gbps 100 --local-us 10                     # BERT-large on GPUs (NVLink-class)

The per-step communication time is the gradient (``--gradient-mb``, default BERT-large's
1,340 MB of float32) in buckets of the fusion threshold (``--bucket-mb``, 64), with no overlap
with compute: an upper bound of what backward has to hide.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


@dataclass(frozen=True)
class Machine:
    """The model's parameters (seconds, bytes per second)."""

    alpha: float  # network latency per message
    link: float  # one host's network link
    local_alpha: float  # one synchronisation inside a node
    mem: float  # copy bandwidth per rank inside a node
    reduce: float  # reduction throughput per rank (bytes of input reduced per second)


def ring(m: Machine, size: float, p: int, local: int) -> float:
    if p == 1:
        return 0.0
    nodes = p // local
    alpha, bandwidth = (m.alpha, m.link) if nodes > 1 else (m.local_alpha, m.mem)
    return (2 * (p - 1) * alpha + 2 * (p - 1) / p * size / bandwidth
            + (p - 1) / p * size / m.reduce)


def shared_memory(m: Machine, size: float, local: int) -> float:
    if local == 1:
        return 0.0
    return m.local_alpha + 2 * size / m.mem + (local - 1) / local * size / m.reduce


def hierarchical_phases(m: Machine, size: float, p: int, local: int) -> tuple[float, float,
                                                                               float]:
    """(reduce-scatter in the node, allreduce across nodes, allgather in the node)."""
    nodes = p // local
    inside = (m.local_alpha + size / m.mem + (local - 1) / local * size / m.reduce
              if local > 1 else 0.0)
    gather = m.local_alpha + size / m.mem if local > 1 else 0.0
    across = 0.0
    if nodes > 1:
        across = (2 * (nodes - 1) * m.alpha + 2 * (nodes - 1) / nodes * size / m.link
                  + (nodes - 1) / nodes * size / (local * m.reduce))
    return inside, across, gather


def hierarchical(m: Machine, size: float, p: int, local: int) -> float:
    if p // local == 1:
        return shared_memory(m, size, local)
    return sum(hierarchical_phases(m, size, p, local))


def hierarchical_pipelined(m: Machine, size: float, p: int, local: int,
                           chunks: int = 8) -> float:
    if p // local == 1:
        return shared_memory(m, size, local)
    phases = hierarchical_phases(m, size, p, local)
    return max(phases) + (sum(phases) - max(phases)) / chunks


ALGORITHMS = {"ring": ring, "hierarchical": hierarchical,
              "hierarchical, pipelined": hierarchical_pipelined}


# ------------------------------------------------------------------------ calibration
def measured_node_rates() -> tuple[float, float]:
    """(copy, reduce) bytes per second of one core here: numpy over 64 MiB, best of 5."""
    import numpy as np

    a = np.ones(16 * MiB, dtype=np.float32)
    b = np.ones_like(a)
    out = np.empty_like(a)
    copies, adds = [], []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(out, a)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        np.add(a, b, out=out)
        adds.append(time.perf_counter() - start)
    return a.nbytes / min(copies), a.nbytes / min(adds)


def check(m: Machine, files: list[Path], cores: int) -> str:
    """Model vs the medians measured on the namespace cluster.

    All its "hosts" share this machine's ``cores``: with more ranks than cores, each rank's
    copy and reduction rates are divided by ranks per core (the network stack's own CPU time,
    on the same cores, is not modelled)."""
    lines = ["| hosts x ranks | link | size | algorithm | measured | model | model / measured |",
             "|---|---|---:|---|---:|---:|---:|"]
    ratios = []
    for path in files:
        data = json.loads(path.read_text())
        p, local = data["size"], data["local_size"]
        link = data["link_Bps"]
        shaped = data.get("shaping", {}).get("rate", "unshaped")
        share = max(1.0, p / cores)
        machine = Machine(m.alpha, link, m.local_alpha, m.mem / share, m.reduce / share)
        for algorithm, model in (("ring", ring), ("hierarchical", hierarchical)):
            for key, times in data["results"].get(algorithm, {}).items():
                size = float(key) * MiB
                measured = statistics.median(times)
                predicted = model(machine, size, p, local)
                ratios.append(predicted / measured)
                lines.append(f"| {p // local} x {local} | "
                             f"{shaped} ({link * 8 / 1e9:.2f} Gbit/s measured) | "
                             f"{float(key):g} MiB | {algorithm} | {1e3 * measured:.1f} ms | "
                             f"{1e3 * predicted:.1f} ms | {predicted / measured:.2f} |")
    if ratios:
        lines.append("")
        lines.append(f"model / measured: median {statistics.median(ratios):.2f}, range "
                     f"{min(ratios):.2f} .. {max(ratios):.2f} over {len(ratios)} points")
    return "\n".join(lines)


def scale_table(m: Machine, ranks: list[int], links_gbit: list[float], local: int,
                gradient: float, bucket: float) -> str:
    lines = [f"Allreduce of one {bucket / MiB:g} MiB bucket, and a step's communication "
             f"({gradient / 1e6:,.0f} MB of gradients in such buckets, no overlap), "
             f"{local} ranks per node:", "",
             "| ranks | link | " + " | ".join(f"{a} bucket" for a in ALGORITHMS)
             + " | " + " | ".join(f"{a} step" for a in ALGORITHMS) + " |",
             "|---:|---:|" + "---:|" * (2 * len(ALGORITHMS))]
    buckets = gradient / bucket
    for p in ranks:
        for gbit in links_gbit:
            machine = Machine(m.alpha, gbit * 1e9 / 8, m.local_alpha, m.mem, m.reduce)
            per = [fn(machine, bucket, p, min(local, p)) for fn in ALGORITHMS.values()]
            lines.append(f"| {p} | {gbit:g} Gbit/s | "
                         + " | ".join(f"{1e3 * t:.1f} ms" for t in per) + " | "
                         + " | ".join(f"{t * buckets:.2f} s" for t in per) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--alpha-us", type=float, default=50.0,
                        help="network latency per message (microseconds)")
    parser.add_argument("--local-us", type=float, default=20.0,
                        help="one synchronisation inside a node (microseconds)")
    parser.add_argument("--mem-gbps", type=float, default=None,
                        help="copy bandwidth per rank in a node (GB/s; default: measured here)")
    parser.add_argument("--reduce-gbps", type=float, default=None,
                        help="reduction throughput per rank (GB/s; default: measured here)")
    parser.add_argument("--check", nargs="*", metavar="JSON", default=None,
                        help="compare with these benchmarks/netns_allreduce.py --json files "
                             "(none named: every benchmarks/results/netns-*.json)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 1024])
    parser.add_argument("--links-gbit", type=float, nargs="+", default=[10, 25, 100, 400])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--gradient-mb", type=float, default=1340.0,
                        help="gradient bytes per step (default: BERT-large, float32)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    args = parser.parse_args(argv)
    copy_rate, add_rate = measured_node_rates()
    mem = args.mem_gbps * 1e9 if args.mem_gbps else copy_rate
    red = args.reduce_gbps * 1e9 if args.reduce_gbps else add_rate
    machine = Machine(args.alpha_us * 1e-6, 0.0, args.local_us * 1e-6, mem, red)
    print(f"parameters: alpha {args.alpha_us:g} us, local alpha {args.local_us:g} us, copy "
          f"{mem / 1e9:.1f} GB/s and reduce {red / 1e9:.1f} GB/s per rank"
          f"{' (measured here)' if not (args.mem_gbps and args.reduce_gbps) else ''}\n")
    if args.check is not None:
        files = ([Path(f) for f in args.check] if args.check
                 else sorted((ROOT / "benchmarks" / "results").glob("netns-*.json")))
        missing = [str(f) for f in files if not f.is_file()]
        if missing or not files:
            print(f"no such benchmark file: {', '.join(missing)}" if missing
                  else "no benchmarks/results/netns-*.json to compare with", file=sys.stderr)
            return 2
        import os
        print(check(machine, files, os.cpu_count() or 1))
        return 0
    print(scale_table(machine, args.ranks, args.links_gbit, args.ranks_per_node,
                      args.gradient_mb * 1e6, args.bucket_mb * MiB))
    return 0


if __name__ == "__main__":
    sys.exit(main())
