"""The sweep summary over a multirun's points, and the exit code it gives the command line."""

import json

from omegaconf import OmegaConf

from ftexp.tracking.result import RESULT_FILE
from ftexp.tracking.sweep import SweepSummaryCallback, sweep_exit_code


def _point(sweep_dir, num, passed=None, p="0.2"):
    point = sweep_dir / str(num)
    (point / ".hydra").mkdir(parents=True)
    overrides = [f"scenario.soak.crash_probability={p}", f"seed={num}"]
    (point / ".hydra" / "overrides.yaml").write_text("\n".join(overrides))
    if passed is not None:  # None: the point's job died before writing its result
        (point / RESULT_FILE).write_text(json.dumps({"run_dir": str(point), "passed": passed, "overrides": overrides,
                                                     "injections": 3, "heals": 3, "final_metrics": {"train/loss": 0.5},
                                                     "wall_time_s": 12.0, "failed_checks": []}))


def _end_multirun(sweep_dir):
    SweepSummaryCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}}))
    return json.loads((sweep_dir / "sweep_summary.json").read_text())


def test_all_points_passed_exits_0(tmp_path):
    _point(tmp_path, 0, True)
    _point(tmp_path, 1, True, p="0.5")
    summary = _end_multirun(tmp_path)
    assert (summary["passed"], summary["total"]) == (2, 2)
    assert summary["pass_rate_by_crash_probability"] == {"0.2": 1.0, "0.5": 1.0}
    assert sweep_exit_code() == 0
    assert (tmp_path / "sweep_summary.md").read_text().startswith("# ftexp sweep: 2/2 points PASSED")


def test_a_failed_or_missing_point_exits_1(tmp_path):
    _point(tmp_path, 0, True)
    _point(tmp_path, 1, False)
    _point(tmp_path, 2, None, p="0.5")
    summary = _end_multirun(tmp_path)
    assert [r["passed"] for r in summary["points"]] == [True, False, False]
    assert summary["points"][2]["failed_checks"] == ["no result file"]
    assert summary["pass_rate_by_crash_probability"] == {"0.2": 0.5, "0.5": 0.0}
    assert sweep_exit_code() == 1


def _soak_point(sweep_dir, num, p, injections):
    _point(sweep_dir, num, True, p=p)
    path = sweep_dir / str(num) / RESULT_FILE
    result = json.loads(path.read_text())
    result["soak"] = {"injections": [{"mode": m, "detection_s": d, "recovery_s": r, "degraded_rollouts": g}
                                     for m, d, r, g in injections]}
    path.write_text(json.dumps(result))


def test_soak_points_pool_their_recovery_figures_per_crash_probability(tmp_path):
    _soak_point(tmp_path, 0, "0.2", [("sigkill", 0.1, 5.0, 1), ("deadlock", 11.0, 20.0, 3)])
    _soak_point(tmp_path, 1, "0.2", [("sigkill", 0.3, 7.0, 1), ("sigkill", 0.2, None, 2)])  # never healed back
    _soak_point(tmp_path, 2, "0.5", [("exit", 0.4, 6.0, 0)])
    summary = _end_multirun(tmp_path)
    recovery = summary["recovery_by_crash_probability"]
    assert list(recovery) == ["0.2", "0.5"]
    assert recovery["0.2"]["sigkill"] == {"injections": 3, "median_detection_s": 0.2, "max_detection_s": 0.3,
                                          "median_recovery_s": 6.0, "max_recovery_s": 7.0,
                                          "mean_degraded_rollouts": 1.33, "max_degraded_rollouts": 2}
    assert recovery["0.2"]["all"]["injections"] == 4 and recovery["0.2"]["all"]["max_recovery_s"] == 20.0
    assert set(recovery["0.5"]) == {"all", "exit"}
    markdown = (tmp_path / "sweep_summary.md").read_text()
    assert "| 0.2 | sigkill | 3 | 0.2 / 0.3 | 6.0 / 7.0 | 1.33 / 2 |" in markdown
    assert (tmp_path / "sweep_recovery.png").stat().st_size > 0


def test_a_sweep_without_soak_points_has_no_recovery_figures(tmp_path):
    _point(tmp_path, 0, True)
    summary = _end_multirun(tmp_path)
    assert summary["recovery_by_crash_probability"] == {}
    assert "Recovery per injection" not in (tmp_path / "sweep_summary.md").read_text()
    assert not (tmp_path / "sweep_recovery.png").exists()
