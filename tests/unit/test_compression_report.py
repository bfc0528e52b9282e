"""benchmarks/compression_training.py's table: medians over seeds, a missed target counts."""

import sys

from support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compression_training  # noqa: E402


def row(compressor, seed, seconds, accuracy=0.97, step_ms=10.0):
    return {"model": "cnn", "compressor": compressor, "seed": seed, "parameters": 1_000_000,
            "payload_bytes": 4e6, "step_ms": step_ms, "final_accuracy": accuracy,
            "epoch_to_target": None if seconds is None else 3, "seconds_to_target": seconds,
            "train_seconds": 9.0, "steps": 100}


def table_line(text, compressor):
    return next(line for line in text.splitlines() if line.startswith(f"| {compressor} |"))


def test_medians_over_seeds_and_a_missed_target_counts_as_infinitely_slow():
    data = {"size": 4, "load": [1.0, 1.0, 1.0], "rows": [
        row("none", 0, 4.0), row("none", 1, 6.0), row("none", 2, 5.0),
        row("powersgd4", 0, 2.0), row("powersgd4", 1, None), row("powersgd4", 2, 3.0),
        row("topk", 0, 1.0, 0.5), row("topk", 1, None, 0.6), row("topk", 2, None, 0.7)]}
    text = compression_training.report(data, "test link", {"cnn": 0.97})
    assert "medians over 3 seeds" in text
    assert "| 5.0 s | 3/3 |" in table_line(text, "none")
    # 2 s, 3 s and never: the median is 3 s, and the table says one seed missed.
    assert "| 3.0 s | 2/3 | 3 | 0.60x |" in table_line(text, "powersgd4")
    assert "| not reached | 1/3 |" in table_line(text, "topk")
    assert "60.00% (50.00-70.00)" in table_line(text, "topk")


def test_runs_from_before_seeds_existed_still_print():
    old = row("none", 0, 4.0)
    del old["seed"]
    text = compression_training.report({"size": 4, "load": [1.0], "rows": [old]}, "l",
                                       {"cnn": 0.97})
    assert "| 4.0 s | 1/1 |" in table_line(text, "none")


def test_goal_lines_judge_time_accuracy_and_fp16():
    data = {"size": 4, "load": [1.0], "rows": [
        row("none", 0, 10.0, 0.980), row("fp16", 0, 8.0, 0.978),
        row("powersgd4", 0, 4.0, 0.976),    # 0.40x, -0.4 points, faster than fp16: met
        row("powersgd16", 0, 6.0, 0.980),   # 0.60x: not met
        row("powersgd1", 0, 3.0, 0.970)]}   # -1.0 points: not met
    goals = {line.split(":")[0]: line for line in
             compression_training.report(data, "l", {"cnn": 0.97}).splitlines()
             if line.startswith("- powersgd")}
    assert goals["- powersgd4"].endswith("**goal met**"), goals
    assert "0.40x none's time" in goals["- powersgd4"]
    assert "0.50x fp16's time" in goals["- powersgd4"]
    assert goals["- powersgd16"].endswith("goal not met")
    assert "-1.00 points" in goals["- powersgd1"] and goals["- powersgd1"].endswith("not met")
