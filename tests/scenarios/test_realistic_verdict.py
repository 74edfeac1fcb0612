"""scenario=realistic's accuracy verdict: any eval reaching the threshold passes (unless the start already
reached it), and the curve it reports.

Also the metrics reading it relies on: eval lines written beside the training metrics of the same
step are merged per key, not one line replacing the other.
"""

import json

import pytest

from ftexp.errors import RunDirError
from ftexp.pipeline import read_metric_series
from ftexp.scenarios.realistic import check_accuracy
from ftexp.tasks.accuracy import eval_curves


def _metrics(root, *rows):
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _run(tmp_path, curve):
    rows = []
    for step, value in curve:  # as the driver and the first alive cell write them: eval first, then training
        rows.append({"step": step, "attempt": 0, "eval/arith": value})
        rows.append({"step": step, "attempt": 1, "train/loss": 0.5, "rollout/reward_mean": value / 2})
    return _metrics(tmp_path / "target", *rows)


def test_any_eval_reaching_the_threshold_passes(tmp_path):
    check = check_accuracy(_run(tmp_path, [(0, 0.40), (5, 0.63), (10, 0.58)]), threshold=0.6)
    assert check.passed
    assert check.details["start"] == 0.40 and check.details["best"] == 0.63 and check.details["best_step"] == 5
    assert check.details["final"] == 0.58 and check.details["curve"] == [[0, 0.40], [5, 0.63], [10, 0.58]]
    assert "start 0.400" in check.summary and "best 0.630 (before rollout 5)" in check.summary


def test_accuracy_below_the_threshold_fails(tmp_path):
    check = check_accuracy(_run(tmp_path, [(0, 0.40), (5, 0.45), (10, 0.599)]), threshold=0.6)
    assert not check.passed and "never reached" in check.summary


def test_a_threshold_the_start_already_reaches_fails_closed(tmp_path):
    # A run whose engines froze at the start would pass such a threshold: it proves nothing.
    check = check_accuracy(_run(tmp_path, [(0, 0.59), (5, 0.56), (10, 0.62)]), threshold=0.58)
    assert not check.passed
    assert "already reached at the start" in check.summary and "start 0.590" in check.summary
    assert check_accuracy(_run(tmp_path, [(0, 0.579), (5, 0.56), (10, 0.62)]), threshold=0.58).passed


def test_no_eval_fails_closed(tmp_path):
    check = check_accuracy(_metrics(tmp_path / "target", {"step": 0, "attempt": 0, "train/loss": 1.0}), threshold=0.1)
    assert not check.passed and "no eval accuracy" in check.summary


def test_eval_and_training_lines_of_one_step_merge(tmp_path):
    root = _run(tmp_path, [(0, 0.4), (1, 0.5)])
    series = read_metric_series(root)
    assert series["eval/arith"] == [(0, 0.4), (1, 0.5)]
    assert series["train/loss"] == [(0, 0.5), (1, 0.5)]
    # per key the highest attempt still wins
    _metrics(root, {"step": 0, "attempt": 0, "train/loss": 9.0}, {"step": 0, "attempt": 2, "train/loss": 1.0},
             {"step": 0, "attempt": 1, "train/loss": 5.0})
    assert read_metric_series(root)["train/loss"] == [(0, 1.0)]


def test_a_bad_metrics_line_is_named(tmp_path):
    root = tmp_path / "target"
    root.mkdir()
    (root / "metrics.jsonl").write_text('{"step": 0, "attempt": 0, "eval/arith": 0.5}\nnot json\n')
    with pytest.raises(RunDirError, match="metrics.jsonl:2"):
        eval_curves(root)
    assert eval_curves(root, strict=False) == {"eval/arith": [(0, 0.5)]}
