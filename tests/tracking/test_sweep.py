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
