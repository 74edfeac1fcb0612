"""prepare → for each phase: baseline, then target → verify → report.

``run_stage`` is what ``python -m ftexp`` calls once the config is valid. The run directory is the
experiment (``ftexp.rundir``): the rollouts recorded once and shared by both sides, one directory
per training job, and the verdict files.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from omegaconf import OmegaConf

from ftexp.config import ExperimentConfig, Stage
from ftexp.engines.torch.model import build_model
from ftexp.errors import InputError
from ftexp.launch.capacity import check_capacity
from ftexp.launch.detached import submit_run, wait_for_submission
from ftexp.launch.jobs import JobFailed
from ftexp.launch.sides import train_sides
from ftexp.rollout.recorded import generate_rollout, save_rollout
from ftexp.rundir import BASELINE, CURVES, METRICS_FILE, REPORT_JSON, REPORT_MD, TARGET, rollout_data_dir, rollout_path
from ftexp.scenarios import load_scenario
from ftexp.tracking import track
from ftexp.tracking.result import build_result, write_result
from ftexp.verify.report import CheckResult, Verdict, plot_curves, write_report

log = logging.getLogger("ftexp")


def prepare(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """Record every rollout the scenario trains on, sampled from the initial policy."""
    data_dir = rollout_data_dir(run_dir)
    model = build_model(cfg.trainer.model)
    for rollout_id in range(cfg.scenario.num_rollout):
        path = rollout_path(data_dir, rollout_id)
        if not path.exists():
            save_rollout(generate_rollout(model, rollout_id, cfg.trainer.rollout), path)
    log.info("recorded %d rollouts in %s", cfg.scenario.num_rollout, data_dir)
    return data_dir


def read_metric_series(side_root: Path) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(rollout_id, value)]}`` over every phase's metrics.jsonl; the highest attempt wins."""
    latest: dict[int, tuple[int, dict]] = {}
    for path in sorted(side_root.glob(f"**/{METRICS_FILE}")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            step, attempt = row.pop("step"), row.pop("attempt")
            if step not in latest or attempt >= latest[step][0]:
                latest[step] = (attempt, row)
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(latest):
        for key, value in latest[step][1].items():
            series.setdefault(key, []).append((step, value))
    return series


def verify(cfg: ExperimentConfig, run_dir: Path, extra_checks: list[CheckResult] = (),
           started: float | None = None) -> Verdict:
    """Check, write report + curves + result.json, and hand the curves to the tracker."""
    checks = list(extra_checks) or load_scenario(cfg.scenario).verify(cfg, run_dir)
    verdict = Verdict(scenario=cfg.scenario.name, mode=cfg.mode.name, checks=checks)
    write_report(run_dir, verdict, {"run_dir": str(run_dir)})
    baseline, target = read_metric_series(run_dir / BASELINE), read_metric_series(run_dir / TARGET)
    plot_curves(baseline, target, run_dir / CURVES, f"{cfg.scenario.name} / {cfg.mode.name}: baseline vs target",
                keys=["train/loss", "train/grad_norm", "train/pg_loss", "train/entropy", "rollout/reward_mean"])
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    final = {k: v[-1][1] for k, v in target.items() if v}
    wall = time.monotonic() - started if started is not None else 0.0
    write_result(run_dir, build_result(run_dir, verdict, overrides, wall, final))
    track(cfg, run_dir, baseline, target, verdict)
    status = "PASSED" if verdict.passed else "FAILED"
    log.info("verdict: %s — %s", status, run_dir / REPORT_MD)
    for check in checks:
        if not check.passed:
            log.info("  FAILED %s: %s", check.name, check.summary)
    return verdict


def run_stage(cfg: ExperimentConfig, run_dir: Path) -> int:
    """Run the requested stage; return the process exit code (0 passed, 1 failed)."""
    started = time.monotonic()
    run_dir.mkdir(parents=True, exist_ok=True)
    stage = cfg.stage
    if stage == Stage.collect:
        failure = wait_for_submission(run_dir, cfg.launcher.poll_interval_s)
        if failure:
            return 0 if verify(cfg, run_dir, [CheckResult("training", False, failure.splitlines()[0],
                                                          {"log_tail": failure})]).passed else 1
        stage = Stage.compare
    if stage == Stage.compare:
        if not all((run_dir / side).is_dir() for side in load_scenario(cfg.scenario).sides):
            raise InputError(f"{run_dir} holds no baseline/ and target/ training results")
        return 0 if verify(cfg, run_dir).passed else 1
    check_capacity(cfg)
    prepare(cfg, run_dir)
    if stage == Stage.prepare:
        return 0
    if stage == Stage.run and not cfg.launcher.wait:
        job_id = submit_run(cfg, run_dir)
        print(f"submitted job {job_id} ({cfg.launcher.name.value}); run dir {run_dir}\n"
              f"collect the verdict with: python -m ftexp mode={cfg.mode.name} scenario={cfg.scenario.name} "
              f"stage=collect run_dir={run_dir}")
        return 0
    sides = {Stage.baseline: (BASELINE,), Stage.target: (TARGET,), Stage.run: (BASELINE, TARGET)}[stage]
    for stale in (REPORT_JSON, REPORT_MD, CURVES):
        (run_dir / stale).unlink(missing_ok=True)  # never leave an old verdict beside new results
    try:
        train_sides(cfg, run_dir, sides, cfg.phase)
    except JobFailed as e:
        log.error("%s", e)
        verify(cfg, run_dir, [CheckResult(name="training", passed=False, summary=str(e).splitlines()[0],
                                          details={"log_tail": str(e)})], started)
        return 1
    if stage != Stage.run:
        return 0
    return 0 if verify(cfg, run_dir, started=started).passed else 1
