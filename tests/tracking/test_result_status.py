"""result.json without a verdict (ERROR, INTERRUPTED) and what a sweep summary makes of it: not passed."""

import json

from omegaconf import OmegaConf

from ftexp.tracking.result import RESULT_FILE, result_passed, write_status_result
from ftexp.tracking.sweep import SweepSummaryCallback, sweep_exit_code


def test_status_result(tmp_path):
    (tmp_path / RESULT_FILE).write_text(json.dumps({"passed": True, "status": "PASSED"}))
    write_status_result(tmp_path, "ERROR", "missing checkpoint tracker /r/ckpt/x.txt", "with_failure", "dp2",
                        ["mode=dp2"], 1.23)
    result = json.loads((tmp_path / RESULT_FILE).read_text())
    assert result["passed"] is False and result["status"] == "ERROR" and result["cause"].startswith("missing")
    assert not result_passed(result)


def test_only_an_explicit_pass_passes():
    assert result_passed({"passed": True}) and result_passed({"passed": True, "status": "PASSED"})
    for claim in ({"passed": True, "status": "ERROR"}, {"passed": "yes"}, {"passed": False}, [], None):
        assert not result_passed(claim)


def test_sweep_counts_error_interrupted_and_unreadable_points_as_not_passed(tmp_path):
    rows = {0: {"passed": True, "status": "PASSED"}, 1: {"passed": False, "status": "ERROR", "cause": "bad dump"},
            2: {"passed": False, "status": "INTERRUPTED"}, 3: {"passed": True, "status": "ERROR"}, 4: "{not json"}
    for num, content in rows.items():
        point = tmp_path / str(num)
        (point / ".hydra").mkdir(parents=True)
        (point / ".hydra" / "overrides.yaml").write_text(f"- seed={num}")
        (point / RESULT_FILE).write_text(content if isinstance(content, str) else json.dumps(
            {"run_dir": str(point), "overrides": [f"seed={num}"], **content}))
    SweepSummaryCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [(r["passed"], r["status"]) for r in summary["points"]] == [
        (True, "PASSED"), (False, "ERROR"), (False, "INTERRUPTED"), (False, "ERROR"), (False, "ERROR")]
    assert summary["points"][4]["failed_checks"][0].startswith("unreadable result file")
    assert (summary["passed"], summary["total"]) == (1, 5) and sweep_exit_code() == 1
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "| INTERRUPTED |" in md and md.startswith("# ftexp sweep: 1/5 points PASSED")
