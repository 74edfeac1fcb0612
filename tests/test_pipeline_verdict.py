"""The pipeline keeps a run dir's verdict honest: a stage that does not complete its verification
leaves ERROR (bad input) or INTERRUPTED, never the old PASSED; only a completed one writes a verdict."""

import json
import tempfile

import pytest

from ftexp import atomic_files, pipeline
from ftexp.cli import _precompose, register_configs
from ftexp.errors import InputError, Interrupted, RunDirError
from ftexp.verify.report import CheckResult, Verdict, write_report
from ftexp.tracking.result import write_result

VERDICT = ("report.md", "report.json", "result.json")


def _passing_run_dir(path):
    for side in ("baseline", "target"):
        (path / side).mkdir(parents=True)
    verdict = Verdict("no_failure", "dp2", [CheckResult("dumps", True, "ok")])
    write_report(path, verdict, {})
    write_result(path, {"passed": True, "status": "PASSED"})
    (path / "curves.png").write_bytes(b"png")
    return path


def _statuses(run_dir):
    md = (run_dir / "report.md").read_text().splitlines()[0]
    return (md, json.loads((run_dir / "report.json").read_text())["status"],
            json.loads((run_dir / "result.json").read_text())["status"])


def _cfg(run_dir, *overrides):
    register_configs()
    return _precompose(["mode=dp2", "scenario=no_failure", f"run_dir={run_dir}", *overrides])


def test_bad_input_during_compare_leaves_error_with_its_cause(tmp_path, monkeypatch):
    run_dir = _passing_run_dir(tmp_path / "run")
    seen = {}

    def verify(cfg, rd, *args, **kwargs):
        seen["during"] = _statuses(rd)  # while the stage runs, nothing claims a pass
        seen["cause"] = json.loads((rd / "report.json").read_text())["cause"]
        raise RunDirError(f"corrupt dump file {rd}/target/x.pt: UnpicklingError: Unsupported operand 103")

    monkeypatch.setattr(pipeline, "verify", verify)
    with pytest.raises(InputError, match="corrupt dump file"):
        pipeline.run_stage(_cfg(run_dir, "stage=compare"), run_dir)
    assert seen["during"] == ("# ftexp verdict: ERROR", "ERROR", "ERROR")
    assert "stage=compare started" in seen["cause"] and "has not finished" in seen["cause"]
    assert _statuses(run_dir) == ("# ftexp verdict: ERROR", "ERROR", "ERROR")
    assert "corrupt dump file" in json.loads((run_dir / "result.json").read_text())["cause"]
    assert not (run_dir / "curves.png").exists()


@pytest.mark.parametrize("interrupt, signal_name", [(KeyboardInterrupt(), "SIGINT"),
                                                    (KeyboardInterrupt("SIGTERM"), "SIGTERM")])
def test_interrupt_leaves_interrupted(tmp_path, monkeypatch, interrupt, signal_name):
    run_dir = _passing_run_dir(tmp_path / "run")

    def verify(*args, **kwargs):
        raise interrupt

    monkeypatch.setattr(pipeline, "verify", verify)
    with pytest.raises(Interrupted) as info:
        pipeline.run_stage(_cfg(run_dir, "stage=compare"), run_dir)
    assert str(info.value) == (f"interrupted by {signal_name} during verification; no job was running; "
                               f"{run_dir} marked INTERRUPTED")
    assert _statuses(run_dir) == ("# ftexp verdict: INTERRUPTED", "INTERRUPTED", "INTERRUPTED")


def test_an_interrupted_job_names_what_was_cleaned_up(tmp_path, monkeypatch):
    run_dir = _passing_run_dir(tmp_path / "run")
    monkeypatch.setattr(pipeline, "prepare", lambda cfg, rd: None)

    def train_sides(*args):
        raise Interrupted("interrupted by SIGINT during target/phase_b; cancelled job 42 and ended its 9 processes")

    monkeypatch.setattr(pipeline, "train_sides", train_sides)
    with pytest.raises(Interrupted, match=r"during target/phase_b; cancelled job 42 .*; .* marked INTERRUPTED"):
        pipeline.run_stage(_cfg(run_dir, "stage=target"), run_dir)
    assert "cancelled job 42" in (run_dir / "report.md").read_text()


def test_a_refused_config_leaves_a_fresh_dir_alone_and_takes_back_an_old_verdict(tmp_path):
    fresh = tmp_path / "fresh"
    with pytest.raises(InputError, match="rollout engines colocated"):
        pipeline.run_stage(_cfg(fresh, "mode=colocate_dp2_cp2_rollout_ft"), fresh)
    assert not any((fresh / name).exists() for name in VERDICT)
    old = _passing_run_dir(tmp_path / "old")
    with pytest.raises(InputError, match="rollout engines colocated"):
        pipeline.run_stage(_cfg(old, "mode=colocate_dp2_cp2_rollout_ft"), old)
    assert _statuses(old) == ("# ftexp verdict: ERROR", "ERROR", "ERROR")


def test_missing_checkpoint_of_a_resumed_phase(tmp_path):
    run_dir = _passing_run_dir(tmp_path / "run")
    cfg = _cfg(run_dir, "scenario=with_failure", "stage=target", "phase=phase_b")
    with pytest.raises(RunDirError, match=r"target/phase_b resumes from target/phase_a: missing checkpoint tracker"):
        pipeline.run_stage(cfg, run_dir)
    assert _statuses(run_dir)[1:] == ("ERROR", "ERROR")
    assert not (run_dir / "rollout_data").exists()  # refused before anything was recorded or launched


def test_unwritable_run_dir(tmp_path, monkeypatch):
    run_dir = _passing_run_dir(tmp_path / "run")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(run_dir))

    monkeypatch.setattr(atomic_files, "temporary_beside", refused)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    with pytest.raises(InputError, match=f"run dir {run_dir} is not writable: Permission denied"):
        pipeline.run_stage(_cfg(run_dir, "stage=compare"), run_dir)
    assert _statuses(run_dir) == ("# ftexp verdict: ERROR", "ERROR", "ERROR")  # taken back in place


def test_a_training_only_stage_leaves_no_verdict(tmp_path, monkeypatch):
    run_dir = _passing_run_dir(tmp_path / "run")
    monkeypatch.setattr(pipeline, "prepare", lambda cfg, rd: None)
    monkeypatch.setattr(pipeline, "train_sides", lambda *args: None)
    assert pipeline.run_stage(_cfg(run_dir, "stage=baseline"), run_dir) == 0
    assert not any((run_dir / name).exists() for name in (*VERDICT, "curves.png"))
