"""A verification that did not complete leaves ERROR or INTERRUPTED, never a verdict; written even where
the run dir refuses new files, so an old PASSED is taken back."""

import json

import pytest

from ftexp import atomic_files
from ftexp.verify.report import (ERROR, INTERRUPTED, CheckResult, Verdict, status_of, write_report,
                                 write_status_report)


def test_status_report_replaces_a_passed_one(tmp_path):
    write_report(tmp_path, Verdict("no_failure", "dp2", [CheckResult("dumps", True, "ok")]), {})
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "PASSED"
    write_status_report(tmp_path, ERROR, "corrupt dump file /r/x.pt: UnpicklingError: Unsupported operand 103",
                        "no_failure", "dp2", {"run_dir": str(tmp_path)})
    md = (tmp_path / "report.md").read_text()
    assert md.splitlines()[0] == "# ftexp verdict: ERROR" and status_of(md.splitlines()[0]) == ERROR
    assert "corrupt dump file /r/x.pt" in md and "PASSED" not in md
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["passed"] is False and data["status"] == ERROR and data["checks"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]
    assert (tmp_path / "report.md").stat().st_mode & 0o777 == 0o644


def test_status_report_is_never_a_verdict(tmp_path):
    with pytest.raises(ValueError):
        write_status_report(tmp_path, "PASSED", "no", "s", "m")


def test_status_report_in_place_where_the_dir_refuses_new_files(tmp_path, monkeypatch):
    write_report(tmp_path, Verdict("no_failure", "dp2", [CheckResult("dumps", True, "ok")]), {})

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(atomic_files, "temporary_beside", refused)
    with pytest.raises(PermissionError):  # a verdict is never written in place
        write_report(tmp_path, Verdict("no_failure", "dp2", [CheckResult("dumps", True, "ok")]), {})
    write_status_report(tmp_path, INTERRUPTED, "interrupted by SIGINT during target", "no_failure", "dp2")
    assert (tmp_path / "report.md").read_text().startswith("# ftexp verdict: INTERRUPTED")
    assert json.loads((tmp_path / "report.json").read_text())["status"] == INTERRUPTED
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    with pytest.raises(PermissionError):  # nothing to overwrite in place: the caller says so
        write_status_report(fresh, ERROR, "x", "s", "m")
