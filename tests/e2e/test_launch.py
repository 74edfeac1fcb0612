"""Launch paths: -m sweeps through the submitit launcher, non-blocking submission + collect, wandb."""

import json
import subprocess
import sys

import pytest

from ftexp_runner import run_ftexp

pytestmark = pytest.mark.e2e


def test_local_sweep_writes_summary(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ftexp", "-m", "mode=dp2", "scenario=no_failure", "seed=1,2",
                             f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())
    assert summary["total"] == 2 and summary["passed"] == 2
    assert sorted(tuple(p["overrides"]) for p in summary["points"]) == [
        ("mode=dp2", "scenario=no_failure", "seed=1"), ("mode=dp2", "scenario=no_failure", "seed=2")]
    assert all(p["passed"] and p["heals"] == 0 and "train/loss" in p["final_metrics"] for p in summary["points"])
    assert (tmp_path / "sweep" / "sweep_summary.md").read_text().startswith("# ftexp sweep: 2/2 points PASSED")
    assert (tmp_path / "sweep" / "sweep_summary.png").stat().st_size > 0
    # each point ran as its own submitit job
    assert len(list((tmp_path / "sweep" / ".submitit").iterdir())) >= 2


def test_submit_without_waiting_then_collect_into_offline_wandb(tmp_path, monkeypatch):
    """launcher.wait=false returns before training ends; stage=collect waits for it, writes the verdict and, with
    tracking=wandb, one offline wandb run per side holding the metrics."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_dir = tmp_path / "run"
    submitted = run_ftexp("mode=dp2", "launcher.wait=false", f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=300)
    assert submitted.returncode == 0, submitted.stderr
    assert "submitted job" in submitted.stdout and "stage=collect" in submitted.stdout
    assert not (run_dir / "report.md").exists()  # returned before training finished
    collected = run_ftexp("mode=dp2", "stage=collect", "tracking=wandb", f"run_dir={run_dir}", cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr
    assert (run_dir / "report.md").read_text().startswith("# ftexp verdict: PASSED")

    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    sides = {}
    for f in files:
        records = [json.loads(ln) for ln in subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(f)], capture_output=True, text=True,
            check=True, timeout=120).stdout.splitlines() if ln.startswith("{")]
        run = next(r["run"] for r in records if r["type"] == "run")
        history = [r for r in records if r["type"] == "history"]
        sides[run["job_type"]] = (run, history)
        assert len(history) == 2, "one history row per rollout"
        assert "train/loss" in json.dumps(history[0])
    assert set(sides) == {"baseline", "target"}
    assert len({run["run_group"] for run, _ in sides.values()}) == 1


def test_collect_without_submission_is_bad_input(tmp_path):
    result = run_ftexp("mode=dp2", "stage=collect", f"run_dir={tmp_path}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and "submission.json" in result.stderr
