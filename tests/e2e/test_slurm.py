"""launcher=slurm end to end: every training job is an sbatch job, and sacct saw it run.

Needs a Slurm cluster with accounting (submitit polls job states with sacct), such as the one-node
cluster that ``bash scripts/slurm_local.sh start`` brings up on this machine. Without one the
tests skip; with ``FTEXP_REQUIRE_SLURM=1`` (CI, which starts that cluster) they fail instead.

The runs nest jobs: a ``launcher.wait=false`` run and each ``-m`` sweep point is a job that waits
for the per-side training jobs it submits, as a command line on the login node does
(``test_multinode`` runs that command line). The local cluster lets several jobs share a core
(``OverSubscribe=FORCE`` in its partition), so that those waiting jobs never hold every CPU of its
small node while their side jobs queue behind them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftexp_runner import run_ftexp

pytestmark = pytest.mark.e2e

# Slurm's time limit of each training job: a dp2 side trains in well under a minute, but a loaded
# machine is slower; past this, Slurm kills the job and the run fails instead of hanging.
TIMEOUT_MIN = 15
SLURM = ("launcher=slurm", f"launcher.timeout_min={TIMEOUT_MIN}")


def _slurm_unavailable() -> str | None:
    """Why this machine cannot run Slurm jobs, or None if it can."""
    if shutil.which("sinfo") is None:
        return "sinfo is not on PATH (no Slurm client; `bash scripts/slurm_local.sh start` sets up a local cluster)"
    try:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 30 s"
    if states.returncode != 0:
        return f"sinfo failed: {states.stderr.strip() or states.stdout.strip()}"
    # exactly idle/mix: a suffix (idle*, idle~, ...) means not responding, powered down, rebooting, ...
    if not any(line.split()[-1] in ("idle", "mix") for line in states.stdout.splitlines() if line.split()):
        return f"no Slurm node is idle (sinfo: {states.stdout.strip() or 'no nodes'})"
    if shutil.which("sacct") is None:
        return "sacct is not on PATH (submitit polls job states with it)"
    try:
        accounting = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minutes"], capture_output=True, text=True,
                                    timeout=30)
    except subprocess.TimeoutExpired:
        return "sacct did not answer within 30 s"
    if accounting.returncode != 0:
        return f"sacct does not answer (no accounting; submitit needs it): {accounting.stderr.strip()}"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    reason = _slurm_unavailable()
    if reason is None:
        return
    if os.environ.get("FTEXP_REQUIRE_SLURM") == "1":
        pytest.fail(f"FTEXP_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _job_ids(submitit_dir: Path) -> list[str]:
    """Ids of the jobs submitit submitted into this folder (it names files ``<id>_submitted.pkl``)."""
    ids = sorted(m.group(1) for p in submitit_dir.rglob("*_submitted.pkl")
                 if (m := re.fullmatch(r"(\d+(?:_\d+)?)_submitted\.pkl", p.name)))
    assert ids, f"no job was submitted into {submitit_dir}"
    return ids


def _sacct_states(job_ids: list[str]) -> dict[str, str]:
    """Slurm's accounting record of each job: {job id: state}."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return dict(line.split("|", 1) for line in out.splitlines() if line)


def _assert_completed_in_slurm(job_ids: list[str], settle_s: float = 60.0) -> None:
    """Slurm recorded every job as COMPLETED. A job whose result file is written counts as done for
    submitit, while Slurm still has it RUNNING until its process exits: such states get ``settle_s``."""
    deadline = time.monotonic() + settle_s
    states = _sacct_states(job_ids)
    while any(state in ("RUNNING", "COMPLETING") for state in states.values()) and time.monotonic() < deadline:
        time.sleep(1.0)
        states = _sacct_states(job_ids)
    assert states == {job: "COMPLETED" for job in job_ids}, f"sacct: {states}"


def _assert_trained_through_slurm(run_dir: Path) -> None:
    for side in ("baseline", "target"):
        ids = _job_ids(run_dir / side / "submitit")
        assert len(ids) == 1, f"{side}: one training job expected, got {ids}"
        _assert_completed_in_slurm(ids)


def test_submit_without_waiting_then_collect_on_slurm(tmp_path, request):
    run_dir = tmp_path / "run"
    submitted = run_ftexp("mode=dp2", "scenario=no_failure", *SLURM, "launcher.wait=false",
                          f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=300)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert "submitted job" in submitted.stdout and "stage=collect" in submitted.stdout
    submission = json.loads((run_dir / "submission.json").read_text())
    assert submission["launcher"] == "slurm"
    # if the test fails before the run job ends, do not leave it running (no-op once it has ended)
    request.addfinalizer(lambda: subprocess.run(["scancel", submission["job_id"]], capture_output=True, timeout=60))
    queued = subprocess.run(["squeue", "-h", "-j", submission["job_id"], "-o", "%T"], capture_output=True,
                            text=True, timeout=60).stdout.strip()
    assert queued in ("PENDING", "CONFIGURING", "RUNNING"), f"squeue: {queued!r}"  # returned before the job ended
    assert not (run_dir / "report.md").exists()

    collected = run_ftexp("mode=dp2", "scenario=no_failure", *SLURM, "stage=collect", f"run_dir={run_dir}",
                          cwd=tmp_path)
    assert collected.returncode == 0, collected.stderr[-3000:]
    assert (run_dir / "report.md").read_text().startswith("# ftexp verdict: PASSED")
    _assert_completed_in_slurm([submission["job_id"]])  # the run job, which submitted the two below
    _assert_trained_through_slurm(run_dir)


def test_sweep_points_are_slurm_jobs(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run([sys.executable, "-m", "ftexp", "-m", "mode=dp2", "scenario=no_failure", "seed=1,2", *SLURM,
                             f"hydra.launcher.timeout_min={TIMEOUT_MIN}", f"hydra.sweep.dir={sweep_dir}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert summary["total"] == 2 and summary["passed"] == 2, json.dumps(summary["points"], indent=1)[-3000:]
    assert sorted(o for p in summary["points"] for o in p["overrides"] if o.startswith("seed=")) == ["seed=1", "seed=2"]
    # each sweep point ran as a Slurm (array) job, and trained its two sides as Slurm jobs of its own
    points = _job_ids(sweep_dir / ".submitit")
    assert len(points) == 2, points
    _assert_completed_in_slurm(points)
    for num in ("0", "1"):
        _assert_trained_through_slurm(sweep_dir / num)
