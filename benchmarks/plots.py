"""Draw the documentation's plots from the checked-in benchmark results (benchmarks/results).

    .venv/bin/python benchmarks/plots.py --out /tmp/plots        # every plot, as SVG
    .venv/bin/python benchmarks/plots.py --out /tmp/plots --only allreduce-bandwidth

The documentation's build calls :func:`render` (tools/docs/hooks.py), so the site always shows
the files in ``benchmarks/results``; ``runs.json`` there says which run each file holds (date,
machine, load, command), and :func:`caption` turns that into the text under a plot.
Needs matplotlib (``pip install 'mpitrain[docs]'``).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1024 * 1024


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def run_info(name: str) -> dict[str, str]:
    """What ``runs.json`` says about one result file."""
    return _load("runs.json")["runs"][name]


def _size_label(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


def _figure(plt: Any, panels: int, width: float = 4.2, height: float = 3.4) -> tuple[Any, Any]:
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), squeeze=False)
    return fig, list(axes[0])


# ------------------------------------------------------------------ allreduce on one machine
ALLREDUCE = "allreduce.json"
_ALLREDUCE_LINES = (("api", "mpitrain hvd.allreduce (engine + data plane)", "C0", "-"),
                    ("mpitrain:auto", "mpitrain data plane alone (auto)", "C0", "--"),
                    ("mpi4py", "MPI's own Allreduce (Open MPI)", "C3", "-"),
                    ("gloo", "torch.distributed, Gloo", "C2", "-"))


def allreduce_bandwidth(plt: Any) -> Any:
    """Algorithm bandwidth (bytes / time) against message size, one panel per world size."""
    data = _load(ALLREDUCE)
    fig, axes = _figure(plt, len(data))
    for ax, run in zip(axes, data.values()):
        p = run["p"]
        for key, label, color, style in _ALLREDUCE_LINES:
            medians = run["median_s"].get(key, {})
            sizes = sorted(int(s) for s in medians)
            ax.plot(sizes, [s / medians[str(s)] / 1e9 for s in sizes], style, color=color,
                    marker="o", markersize=3, label=label)
        # Every input read once and every output written once: 2*p*S bytes at copy bandwidth.
        ax.axhline(run["copy_Bps"] / (2 * p) / 1e9, color="grey", linestyle=":",
                   label="memory-traffic limit (2·p·S at copy bandwidth)")
        nodes = run.get("nodes", 1)
        ax.set_title(f"p = {p}" + (f" as {nodes} emulated nodes" if nodes > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("algorithm bandwidth (GB/s)")
    axes[-1].legend(fontsize=7, loc="lower right")
    return fig


# ------------------------------------------------------------------ across namespace hosts
NETNS = ("netns-2x2-1gbit.json", "netns-2x2-10gbit.json", "netns-2x2-unshaped.json",
         "netns-3x2-1gbit.json")
_NETNS_LINES = (("mpi", "MPI's own Allreduce, float32", "C3", "-"),
                ("auto", "mpitrain auto, float32", "C0", "-"),
                ("auto-fp16", "mpitrain auto, float16", "C1", "-"),
                ("hierarchical-fp16", "mpitrain hierarchical, float16", "C1", "--"))


def _link_name(run: dict[str, Any]) -> str:
    rate = run.get("shaping", {}).get("rate")
    hosts = run["size"] // run["local_size"]
    link = f"tbf {rate}" if rate else "unshaped veth"
    return f"{hosts} hosts x {run['local_size']} ranks, {link} ({run['link_Bps'] / 1e6:.0f} MB/s)"


def multinode_time(plt: Any) -> Any:
    """Allreduce time per message size on each link, beside MPI's and the link's limit."""
    fig, axes = _figure(plt, len(NETNS), width=3.9)
    for ax, name in zip(axes, NETNS):
        run = _load(name)
        hosts = run["size"] // run["local_size"]
        for key, label, color, style in _NETNS_LINES:
            rounds = run["results"].get(key, {})
            sizes = sorted(rounds, key=float)
            ax.plot([float(s) for s in sizes], [1e3 * statistics.median(rounds[s]) for s in sizes],
                    style, color=color, marker="o", markersize=3, label=label)
        # Each host must send (and receive) 2(h-1)/h of the node's buffer over its link.
        sizes = sorted(float(s) for s in run["results"]["mpi"])
        share = 2 * (hosts - 1) / hosts
        for width, label, style in ((1.0, "link limit, float32", ":"),
                                    (0.5, "link limit, float16", "-.")):
            ax.plot(sizes, [1e3 * share * width * s * MiB / run["link_Bps"] for s in sizes],
                    style, color="grey", label=label)
        ax.set_title(_link_name(run), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("allreduce size, float32 elements (MiB)")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("time per allreduce (ms, median)")
    axes[0].legend(fontsize=7, loc="upper left")
    return fig


# ------------------------------------------------------------------ compression
COMPRESSION = "compression-2x2-1gbit.json"
_COMPRESSORS = (("none", "C3"), ("fp16", "C1"), ("powersgd1", "C9"), ("powersgd4", "C0"),
                ("powersgd16", "C4"), ("topk", "C2"), ("onebit", "C7"))


def compression_time_to_accuracy(plt: Any) -> Any:
    """Per model, test accuracy against training time for each compressor.

    Rows that carry ``curve`` ([seconds, accuracy] after each epoch, written by
    compression_training.py) are drawn as curves, the median over seeds epoch by epoch.  An
    older file without them gives bars instead: the median time to the target accuracy, with
    the seeds that reached it and the mean final accuracy."""
    data = _load(COMPRESSION)
    models = list(dict.fromkeys(r["model"] for r in data["rows"]))
    fig, axes = _figure(plt, len(models), width=4.0, height=3.6)
    curves = all("curve" in r for r in data["rows"])
    for ax, model in zip(axes, models):
        rows = [r for r in data["rows"] if r["model"] == model]
        target = 100 * rows[0].get("target", {"mlp": 0.97, "cnn": 0.97}.get(model, 0.95))
        present = [(n, c) for n, c in _COMPRESSORS if any(r["compressor"] == n for r in rows)]
        for index, (name, color) in enumerate(present):
            mine = [r for r in rows if r["compressor"] == name]
            if curves:
                epochs = min(len(r["curve"]) for r in mine)
                t = [statistics.median(r["curve"][e][0] for r in mine) for e in range(epochs)]
                a = [100 * statistics.median(r["curve"][e][1] for r in mine)
                     for e in range(epochs)]
                ax.plot(t, a, color=color, marker="o", markersize=2, label=name)
                continue
            reached = [r["seconds_to_target"] for r in mine if r["seconds_to_target"] is not None]
            final = 100 * statistics.mean(r["final_accuracy"] for r in mine)
            seconds = statistics.median(reached) if 2 * len(reached) > len(mine) else None
            ax.barh(index, seconds or 0, color=color)
            ax.text((seconds or 0) + 0.3, index, f"{len(reached)}/{len(mine)} reached, "
                    f"final {final:.1f}%" if seconds else
                    f"not reached ({len(reached)}/{len(mine)}), final {final:.1f}%",
                    va="center", fontsize=6)
        if curves:
            ax.axhline(target, color="grey", linestyle=":")
            ax.set_xlabel("training time (s, slowest rank)")
            ax.set_ylim(max(0, target - 15), 100)
            ax.legend(fontsize=6, loc="lower right")
        else:
            ax.set_yticks(range(len(present)), [n for n, _ in present])
            ax.invert_yaxis()
            ax.set_xlabel(f"training time to {target:g}% test accuracy (s, median of seeds)")
            ax.set_xlim(0, ax.get_xlim()[1] * 1.6)
        ax.set_title(f"{model} ({rows[0]['parameters'] / 1e6:.2f} M parameters)")
        ax.grid(True, alpha=0.3)
    if curves:
        axes[0].set_ylabel("test accuracy (%)")
    return fig


# ------------------------------------------------------------------ GPU kernels
GPU_KERNELS = "gpu-kernels-h100.json"
_KERNELS = (("pack_of_copy", "pack (gather a fused bucket)"),
            ("unpack_of_copy", "unpack"),
            ("reduce_of_copy", "float32 reduce (2 in, 1 out)"),
            ("reduce16_of_copy", "bfloat16 reduce"))


def gpu_kernel_throughput(plt: Any) -> Any:
    """Each CUDA kernel's throughput as a fraction of the device copy bandwidth measured in
    the same run."""
    rows = _load(GPU_KERNELS)["kernels"]
    fig, axes = _figure(plt, 1, width=6.0, height=3.6)
    ax = axes[0]
    sizes = [r["bytes"] for r in rows]
    for key, label in _KERNELS:
        ax.plot(sizes, [r[key] for r in rows], marker="o", markersize=3, label=label)
    ax.axhline(0.8, color="grey", linestyle=":", label="goal: 80% of copy")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [_size_label(s) for s in sizes])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("buffer size")
    ax.set_ylabel("fraction of device copy bandwidth")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return fig


PLOTS: dict[str, tuple[Callable[[Any], Any], tuple[str, ...]]] = {
    "allreduce-bandwidth": (allreduce_bandwidth, (ALLREDUCE,)),
    "multinode-time": (multinode_time, NETNS),
    "compression-time-to-accuracy": (compression_time_to_accuracy, (COMPRESSION,)),
    "gpu-kernel-throughput": (gpu_kernel_throughput, (GPU_KERNELS,)),
}


def caption(name: str) -> str:
    """Which run(s) a plot shows: file, date, machine, load and command, a Markdown list."""
    lines = []
    for source in PLOTS[name][1]:
        info = run_info(source)
        lines.append(f"* `benchmarks/results/{source}`: {info['date']}, {info['machine']}; "
                     f"{info['load']}. Command: `{info['command']}`")
    return "Run shown:\n\n" + "\n".join(lines)


def render(names: list[str] | None = None) -> dict[str, bytes]:
    """The SVG of each plot, by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "mpitrain",
                         "font.size": 8})
    out = {}
    for name in names or list(PLOTS):
        fig = PLOTS[name][0](plt)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="svg", metadata={"Date": None})
        plt.close(fig)
        out[name] = buffer.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the SVG files")
    parser.add_argument("--only", nargs="+", choices=sorted(PLOTS), help="draw only these")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, svg in render(args.only).items():
        (args.out / f"{name}.svg").write_bytes(svg)
        print(f"{args.out / (name + '.svg')}: {caption(name).splitlines()[2][:100]}...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
