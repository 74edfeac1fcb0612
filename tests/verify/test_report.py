"""The verdict, report.json / report.md, and the curves PNG."""

import json
import math

import pytest

from ftexp.verify.report import CheckResult, Verdict, plot_curves, write_report


def verdict(*passed):
    checks = [CheckResult(f"check_{i}", p, f"summary {i}", {"value": math.nan}) for i, p in enumerate(passed)]
    return Verdict("no_failure", "dp2", checks)


@pytest.mark.parametrize("passed, expected", [((True,), True), ((True, True), True), ((True, False), False),
                                              ((False,), False), ((), False)])
def test_verdict_passes_only_with_checks_all_passed(passed, expected):
    assert verdict(*passed).passed is expected


@pytest.mark.parametrize("passed, word", [((True, True), "PASSED"), ((True, False), "FAILED"), ((), "FAILED")])
def test_write_report(tmp_path, passed, word):
    json_path, md_path = write_report(tmp_path / "run", verdict(*passed), {"seed": 1})
    md = md_path.read_text()
    assert md.splitlines()[0] == f"# ftexp verdict: {word}"
    data = json.loads(json_path.read_text())  # strict JSON: the NaN detail became a string
    assert data["passed"] is (word == "PASSED") and data["scenario"] == "no_failure" and data["extra"] == {"seed": 1}
    assert all(c["details"]["value"] == "nan" for c in data["checks"])
    for i, p in enumerate(passed):
        assert f"| check_{i} | {'PASSED' if p else 'FAILED'} | summary {i} |" in md
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["report.json", "report.md"]  # no temp files


def test_report_overwrites_atomically(tmp_path):
    write_report(tmp_path, verdict(False), {})
    write_report(tmp_path, verdict(True), {})
    assert (tmp_path / "report.md").read_text().startswith("# ftexp verdict: PASSED")
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True


def test_detail_sections(tmp_path):
    record = {"leaf": "fwd_bwd/rollout_1", "name": "grad__w|x", "status": "failed", "rel": 0.02, "max_abs": 0.1,
              "mean_abs": 0.01, "rule": ".*", "predicate": "rel <= 0.0085"}
    row = {"rollout_id": 1, "key": "train/loss", "baseline": 1.0, "target": 1.5, "abs_diff": 0.5, "rel_diff": 0.33,
           "ok": False, "note": "rel_diff > rtol"}
    checks = [
        CheckResult("dumps", False, "1 failed", {"kind": "dumps", "leaves": ["fwd_bwd/rollout_1"], "counts": {},
                                                 "worst": [record], "issues": ["grad__w failed"]}),
        CheckResult("metrics", False, "1 issue", {"kind": "metrics", "rows": [row]}),
        CheckResult("reconfigure", False, "differs", {"kind": "reconfigure", "expected": [{"rollout_id": 2}],
                                                      "actual": []}),
        CheckResult("witness", True, "ok", {"count": 3}),
    ]
    md = write_report(tmp_path, Verdict("with_failure", "dp2", checks), {})[1].read_text()
    assert "| fwd_bwd/rollout_1 | grad__w\\|x | failed | 0.02 |" in md  # '|' escaped inside a cell
    assert "- grad__w failed" in md
    assert "| 1 | train/loss | 1 | 1.5 | 0.5 | 0.33 | NO | rel_diff > rtol |" in md
    assert '| 0 | {"rollout_id": 2} | null | NO |' in md
    assert '"count": 3' in md


def test_plot_curves(tmp_path):
    baseline = {f"train/k{i}": [(r, float(r * i)) for r in range(3)] for i in range(8)}
    target = {"train/k0": [(0, 0.0), (1, 0.1)]}
    path = tmp_path / "curves.png"
    drawn = plot_curves(baseline, target, path, "baseline vs target")
    assert drawn == [f"train/k{i}" for i in range(6)]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_curves(baseline, target, path, "t", keys=["train/k7"]) == ["train/k7"]
    assert plot_curves({}, {}, tmp_path / "empty.png", "t") == []
    assert (tmp_path / "empty.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "empty.png"]
