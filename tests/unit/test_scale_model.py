"""benchmarks/scale_model.py: the formulas' limits, and its --check against the stored runs."""

import importlib.util
import json
import math
import sys

from support import ROOT

spec = importlib.util.spec_from_file_location("scale_model", ROOT / "benchmarks" / "scale_model.py")
model = importlib.util.module_from_spec(spec)
sys.modules["scale_model"] = model  # dataclasses look their module up while it loads
spec.loader.exec_module(model)

M = model.Machine(alpha=50e-6, link=1.25e9, local_alpha=20e-6, mem=10e9, reduce=5e9)
S = 64 * model.MiB


def test_the_ring_on_a_slow_link_is_its_bytes_over_the_link():
    slow = model.Machine(0.0, 1e6, 0.0, 1e15, 1e15)  # only the link matters
    assert math.isclose(model.ring(slow, S, 8, 1), 2 * 7 / 8 * S / 1e6, rel_tol=1e-9)


def test_pipelining_never_costs_more_and_one_node_is_shared_memory():
    for p in (16, 64, 1024):
        assert model.hierarchical_pipelined(M, S, p, 8) <= model.hierarchical(M, S, p, 8)
    assert model.hierarchical(M, S, 8, 8) == model.shared_memory(M, S, 8)
    assert model.ring(M, S, 1, 1) == 0.0


def test_check_compares_every_stored_measurement(capsys):
    assert model.main(["--check", "--mem-gbps", "7", "--reduce-gbps", "5"]) == 0
    out = capsys.readouterr().out
    files = list((ROOT / "benchmarks" / "results").glob("netns-*.json"))
    ring_rows = sum(len(json.loads(f.read_text())["results"].get("ring", {})) for f in files)
    assert files and out.count("| ring |") == ring_rows and "model / measured: median" in out


def test_check_takes_the_files_it_is_given_and_names_a_missing_one(capsys):
    chosen = sorted((ROOT / "benchmarks" / "results").glob("netns-3x2-*.json"))[:1]
    assert model.main(["--check", str(chosen[0]), "--mem-gbps", "7", "--reduce-gbps", "5"]) == 0
    out = capsys.readouterr().out
    assert "| 3 x 2 |" in out and "| 2 x 2 |" not in out
    assert model.main(["--check", "no-such.json", "--mem-gbps", "7", "--reduce-gbps", "5"]) == 2
    assert "no-such.json" in capsys.readouterr().err
