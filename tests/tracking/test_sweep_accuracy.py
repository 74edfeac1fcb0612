"""The accuracy part of a sweep summary: per-point start/best/final, per-crash-probability means and curves."""

import json
from pathlib import Path

from ftexp.tracking.sweep import render_markdown, write_summary


def _point(sweep: Path, job: int, overrides: list[str], curve: list[tuple[int, float]] | None, passed: bool) -> None:
    point = sweep / str(job)
    (point / "target").mkdir(parents=True)
    (point / "result.json").write_text(json.dumps({"passed": passed, "status": "PASSED" if passed else "FAILED",
                                                   "overrides": overrides}))
    lines = [{"step": s, "attempt": 0, "train/loss": 0.1} for s in range(3)]
    lines += [{"step": s, "attempt": 0, "eval/arith": v} for s, v in curve or []]
    (point / "target" / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_sweep_summary_has_accuracy_per_point_and_curves_per_crash_probability(tmp_path):
    _point(tmp_path, 0, ["scenario=realistic", "seed=1", "scenario.soak.crash_probability=0"],
           [(0, 0.40), (5, 0.62), (10, 0.60)], True)
    _point(tmp_path, 1, ["scenario=realistic", "seed=2", "scenario.soak.crash_probability=0"],
           [(0, 0.30), (5, 0.50), (10, 0.58)], True)
    _point(tmp_path, 2, ["scenario=realistic", "seed=1", "scenario.soak.crash_probability=0.3"],
           [(0, 0.40), (5, 0.45), (10, 0.44)], False)
    _point(tmp_path, 3, ["scenario=realistic", "seed=2", "scenario.soak.crash_probability=0.3"], None, False)

    summary = write_summary(tmp_path, 4)
    by_job = {p["job"]: p for p in summary["accuracy"]}
    assert sorted(by_job) == [0, 1, 2]  # the point without evals is left out here (still counted as failed)
    assert (by_job[0]["start"], by_job[0]["best"], by_job[0]["best_step"], by_job[0]["final"]) == (0.40, 0.62, 5, 0.60)
    assert by_job[2]["crash_probability"] == "0.3" and by_job[2]["seed"] == "1"
    assert summary["pass_rate_by_crash_probability"] == {"0": 1.0, "0.3": 0.0}

    markdown = (tmp_path / "sweep_summary.md").read_text()
    assert markdown == render_markdown(summary)
    assert "| 0 | 0 | 1 | 0.400 | 0.620 (5) | 0.600 | PASSED |" in markdown
    assert "| 0 | 2 | 0.350 | 0.600 | 0.590 |" in markdown  # means over the crash probability's points
    assert "| 0.3 | 1 | 0.400 | 0.450 | 0.440 |" in markdown
    assert (tmp_path / "sweep_accuracy.png").stat().st_size > 0


def test_a_sweep_without_evals_has_no_accuracy_part(tmp_path):
    _point(tmp_path, 0, ["scenario=ft_random", "seed=1"], None, True)
    summary = write_summary(tmp_path, 1)
    assert summary["accuracy"] == [] and "Eval accuracy" not in (tmp_path / "sweep_summary.md").read_text()
    assert not (tmp_path / "sweep_accuracy.png").exists()
