"""prepare → for each phase: baseline, then target → verify → report.

``run_stage`` is what ``python -m ftexp`` calls once the config is valid. The run directory is the
experiment (``ftexp.rundir``): the rollouts recorded once and shared by both sides, one directory
per training job, and the verdict files.

The verdict files (report.md, report.json, result.json) say PASSED or FAILED only once a
verification completed. Every stage that trains, verifies or collects first replaces any verdict
already there with ``ERROR`` ("stage=… started at … and has not finished"), so a stage that dies
leaves nothing that claims a pass; bad input leaves ``ERROR`` with its one-line cause, SIGINT or
SIGTERM ``INTERRUPTED`` with what was stopped and cleaned up. A config that is refused before the
stage touches the run dir (capacity, launcher) leaves a fresh run dir as it was, and an old verdict
marked ERROR. A stage that trains without verifying (``stage=baseline|target``, a
``launcher.wait=false`` submission) ends with no verdict files at all.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from ftexp.config import ExperimentConfig, Stage
from ftexp.engines.torch.model import build_model
from ftexp.errors import InputError, Interrupted, RunDirError, file_error, interrupt_signal, one_line
from ftexp.launch.capacity import check_capacity
from ftexp.launch.detached import submit_run, wait_for_submission
from ftexp.launch.jobs import JobFailed, check_launcher, signals_deferred
from ftexp.launch.sides import job_spec, train_sides
from ftexp.rollout.recorded import generate_rollout, load_rollout, save_rollout
from ftexp.rundir import (BASELINE, CURVES, METRICS_FILE, REPORT_JSON, REPORT_MD, RESULT_FILE, TARGET, VERDICT_FILES,
                          rollout_data_dir, rollout_path)
from ftexp.scenarios import load_scenario
from ftexp.tracking import track
from ftexp.tracking.result import build_result, result_passed, write_result, write_status_result
from ftexp.trainer.checkpoint import check_resumable
from ftexp.verify.report import (ERROR, INTERRUPTED, PASSED, CheckResult, Verdict, plot_curves, status_of,
                                 write_report, write_status_report)

log = logging.getLogger("ftexp")


def prepare(cfg: ExperimentConfig, run_dir: Path) -> Path:
    """Record every rollout the scenario trains on, sampled from the initial policy; a rollout
    already recorded is checked, so that a damaged one is bad input before any job starts.

    With live rollout engines there is nothing to record: each side generates every rollout from its
    own current policy, into its own ``rollout_data``.
    """
    data_dir = rollout_data_dir(run_dir)
    if cfg.mode.rollout_num_engines:
        log.info("live rollout engines: each side generates its rollouts while it trains")
        return data_dir
    model = build_model(cfg.trainer.model)
    for rollout_id in range(cfg.scenario.num_rollout):
        path = rollout_path(data_dir, rollout_id)
        if path.exists():
            load_rollout(path, expected_rollout_id=rollout_id)
        else:
            save_rollout(generate_rollout(model, rollout_id, cfg.trainer.rollout), path)
    log.info("recorded %d rollouts in %s", cfg.scenario.num_rollout, data_dir)
    return data_dir


def read_metric_series(side_root: Path, strict: bool = True) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(rollout_id, value)]}`` over every phase's metrics.jsonl; per key, the highest attempt wins.

    Per key, because a step may have lines from two writers: the training metrics of its committed
    attempt and the driver's eval accuracy (``eval/<task>``). ``strict``: an unreadable file or a bad
    line is a RunDirError naming it; otherwise (the curves of a run whose training failed) it is skipped.
    """
    latest: dict[tuple[int, str], tuple[int, float]] = {}
    for path in sorted(side_root.glob(f"**/{METRICS_FILE}")):
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            if strict:
                raise file_error(path, e, "metrics file") from e
            continue
        for lineno, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                step, attempt = row.pop("step"), row.pop("attempt")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                if strict:
                    raise RunDirError(f"{path}:{lineno}: not a valid metrics line: {one_line(e)}") from e
                continue
            for key, value in row.items():
                if (step, key) not in latest or attempt >= latest[(step, key)][0]:
                    latest[(step, key)] = (attempt, value)
    series: dict[str, list[tuple[int, float]]] = {}
    for (step, key), (_, value) in sorted(latest.items()):
        series.setdefault(key, []).append((step, value))
    return series


def _overrides(run_dir: Path) -> list[str]:
    """The run's Hydra overrides, for result.json (informational: an unreadable file gives [])."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        return list(OmegaConf.to_container(OmegaConf.load(path))) if path.is_file() else []
    except Exception as e:  # yaml and OSError alike
        log.warning("cannot read %s: %s", path, one_line(e))
        return []


def verify(cfg: ExperimentConfig, run_dir: Path, extra_checks: list[CheckResult] = (),
           started: float | None = None) -> Verdict:
    """Check, then hand the curves to the tracker and write curves + result.json + report.

    Everything is read and computed before the first verdict file is written; the report comes last.
    ``extra_checks`` (a failed training job) replaces the scenario's checks, and its outputs are read
    leniently: a job that died may have left a cut line.
    """
    checks = list(extra_checks) or load_scenario(cfg.scenario).verify(cfg, run_dir)
    verdict = Verdict(scenario=cfg.scenario.name, mode=cfg.mode.name, checks=checks)
    strict = not extra_checks
    baseline = read_metric_series(run_dir / BASELINE, strict)
    target = read_metric_series(run_dir / TARGET, strict)
    final = {k: v[-1][1] for k, v in target.items() if v}
    wall = time.monotonic() - started if started is not None else 0.0
    result = build_result(run_dir, verdict, _overrides(run_dir), wall, final)
    accuracy = sorted(k for k in target if k.startswith("eval/"))  # a task's eval accuracy comes first
    plot_curves(baseline, target, run_dir / CURVES, f"{cfg.scenario.name} / {cfg.mode.name}: baseline vs target",
                keys=[*accuracy, "train/loss", "train/grad_norm", "train/pg_loss", "train/entropy", "rollout/reward_mean"])
    track(cfg, run_dir, baseline, target, verdict)
    write_result(run_dir, result)
    write_report(run_dir, verdict, {"run_dir": str(run_dir)})
    log.info("verdict: %s — %s", verdict.status, run_dir / REPORT_MD)
    for check in checks:
        if not check.passed:
            log.info("  FAILED %s: %s", check.name, check.summary)
    return verdict


# ---- the verdict files while a stage runs --------------------------------------------------------


def _claims_pass(run_dir: Path) -> list[str]:
    """The verdict files in ``run_dir`` that still say PASSED."""
    claims = []
    try:
        md = run_dir / REPORT_MD
        if md.is_file() and status_of((md.read_text(errors="replace").splitlines() or [""])[0]) == PASSED:
            claims.append(REPORT_MD)
        for name in (REPORT_JSON, RESULT_FILE):
            path = run_dir / name
            if path.is_file() and result_passed(json.loads(path.read_text(errors="replace"))):
                claims.append(name)
    except (OSError, ValueError):
        pass
    return claims


class VerdictFiles:
    """The run dir's verdict files, kept honest while a stage runs (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, started: float) -> None:
        self.cfg, self.run_dir, self.started = cfg, run_dir, started
        self.activity = cfg.stage.value
        self.touched = False  # the stage has written its placeholder: any end now leaves a status

    def _present(self) -> bool:
        return any((self.run_dir / name).exists() for name in VERDICT_FILES)

    def mark(self, status: str, cause: str, *, always: bool = False) -> str:
        """Write ``status`` with ``cause`` into every verdict file and drop the curves. Done when the
        stage has touched the run dir, when there is an old verdict to take back, or ``always``.
        Returns "" or, when the files could not be written, one clause saying so."""
        if not (always or self.touched or self._present()):
            return ""
        name, mode = self.cfg.scenario.name, self.cfg.mode.name
        try:
            write_status_result(self.run_dir, status, cause, name, mode, _overrides(self.run_dir),
                                time.monotonic() - self.started)
            write_status_report(self.run_dir, status, cause, name, mode, {"run_dir": str(self.run_dir)})
        except OSError as e:
            still = _claims_pass(self.run_dir)
            return (f"; the run dir could not be marked {status} ({e.strerror or one_line(e)})"
                    + (f" and its {', '.join(still)} still say PASSED" if still else ""))
        finally:
            try:
                (self.run_dir / CURVES).unlink(missing_ok=True)
            except OSError:
                pass
        return ""

    def take_back_old(self) -> None:
        """Before anything else: an old verdict no longer describes what this stage will leave."""
        if self._present():
            self._placeholder()

    def begin(self) -> None:
        """The stage now works on the run dir: until it ends, the verdict says it has not finished."""
        self._placeholder()
        self.touched = True

    def _placeholder(self) -> None:
        try:  # a run dir that refuses new files cannot hold a verdict (an old one is marked ERROR in place)
            with tempfile.NamedTemporaryFile(dir=self.run_dir, prefix=".ftexp-probe-"):
                pass
        except OSError as e:
            raise InputError(f"run dir {self.run_dir} is not writable: {e.strerror or one_line(e)}") from e
        now = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        note = self.mark(ERROR, f"stage={self.cfg.stage.value} started at {now} (pid {os.getpid()}) and has not "
                                f"finished: no verdict yet", always=True)
        if note:
            raise InputError(f"run dir {self.run_dir} is not writable{note}")

    def clear(self) -> None:
        """A stage that trains without verifying leaves no verdict (run stage=compare for one)."""
        for name in VERDICT_FILES:
            (self.run_dir / name).unlink(missing_ok=True)


# ---- stages --------------------------------------------------------------------------------------


def _check_resumed_phases(cfg: ExperimentConfig, run_dir: Path, sides: tuple[str, ...]) -> None:
    """A phase that resumes from one this stage does not train needs that phase's checkpoint now."""
    phases = [p for p in cfg.scenario.phases if cfg.phase is None or p.name == cfg.phase]
    trained = {p.name for p in phases}
    for phase in phases:
        if phase.load_from is None or phase.load_from in trained:
            continue
        for side in (s for s in sides if s in load_scenario(cfg.scenario).sides):
            try:
                check_resumable(job_spec(cfg, run_dir, side, phase).load_dir)
            except RunDirError as e:
                raise RunDirError(f"{side}/{phase.name} resumes from {side}/{phase.load_from}: {e}") from e


def _run(cfg: ExperimentConfig, run_dir: Path, files: VerdictFiles, started: float) -> int:
    stage = cfg.stage
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"run dir {run_dir} cannot be created: {e.strerror or one_line(e)}") from e
    if stage == Stage.prepare:
        check_capacity(cfg)
        prepare(cfg, run_dir)
        return 0
    files.take_back_old()
    trains = stage in (Stage.run, Stage.baseline, Stage.target)
    if trains:
        check_capacity(cfg)
        check_launcher(cfg.launcher)
    files.begin()
    if stage == Stage.collect:
        files.activity = "collect"
        failure = wait_for_submission(run_dir, cfg.launcher.poll_interval_s)
        if failure:
            files.activity = "verification"
            return 0 if verify(cfg, run_dir, [CheckResult("training", False, failure.splitlines()[0],
                                                          {"log_tail": failure})]).passed else 1
        stage = Stage.compare
    if stage == Stage.compare:
        files.activity = "verification"
        if not all((run_dir / side).is_dir() for side in load_scenario(cfg.scenario).sides):
            raise InputError(f"{run_dir} holds no baseline/ and target/ training results")
        return 0 if verify(cfg, run_dir, started=started).passed else 1
    sides = {Stage.baseline: (BASELINE,), Stage.target: (TARGET,), Stage.run: (BASELINE, TARGET)}[stage]
    _check_resumed_phases(cfg, run_dir, sides)
    files.activity = "prepare"
    prepare(cfg, run_dir)
    if stage == Stage.run and not cfg.launcher.wait:
        files.activity = "submission"
        job_id = submit_run(cfg, run_dir)
        files.clear()  # no verdict until stage=collect writes one
        print(f"submitted job {job_id} ({cfg.launcher.name.value}); run dir {run_dir}\n"
              f"collect the verdict with: python -m ftexp mode={cfg.mode.name} scenario={cfg.scenario.name} "
              f"stage=collect run_dir={run_dir}")
        return 0
    files.activity = "training"
    try:
        train_sides(cfg, run_dir, sides, cfg.phase)
    except JobFailed as e:
        log.error("%s", e)
        files.activity = "verification"
        verify(cfg, run_dir, [CheckResult(name="training", passed=False, summary=str(e).splitlines()[0],
                                          details={"log_tail": str(e)})], started)
        return 1
    if stage != Stage.run:
        files.clear()
        return 0
    files.activity = "verification"
    return 0 if verify(cfg, run_dir, started=started).passed else 1


def run_stage(cfg: ExperimentConfig, run_dir: Path) -> int:
    """Run the requested stage; return the process exit code (0 passed, 1 failed).

    Raises InputError (exit 2) or Interrupted (exit 130) with one line, after marking the run dir
    ERROR or INTERRUPTED.
    """
    started = time.monotonic()
    files = VerdictFiles(cfg, run_dir, started)
    try:
        return _run(cfg, run_dir, files, started)
    except KeyboardInterrupt as e:
        cause = str(e) if isinstance(e, Interrupted) else \
            f"interrupted by {interrupt_signal(e)} during {files.activity}; no job was running"
        with signals_deferred():
            note = files.mark(INTERRUPTED, cause)
        raise Interrupted(cause + (note or (f"; {run_dir} marked {INTERRUPTED}" if files.touched else ""))) from None
    except InputError as e:
        note = files.mark(ERROR, str(e))
        if note:
            raise InputError(f"{e}{note}") from e
        raise
    except OSError as e:  # a run-dir file that cannot be read or written
        error = RunDirError(f"{e.filename}: {e.strerror or one_line(e)}" if e.filename else one_line(e))
        note = files.mark(ERROR, str(error))
        raise RunDirError(f"{error}{note}") from e
    except Exception as e:  # a bug: its traceback follows, and the run dir says ERROR meanwhile
        files.mark(ERROR, f"{one_line(e)} (an internal error: see the traceback on stderr)")
        raise
