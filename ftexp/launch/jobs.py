"""Training jobs through submitit: one job per (side, phase).

``run_side_job(spec, launcher)`` submits (locally or to Slurm) :func:`train_side` and waits for it. The job's stdout
and stderr — including every Ray worker's and every DP rank's output — land in
the side's ``train.log``. A job that dies hard (``os._exit``, SIGKILL) is detected as soon as
its process ends, not after submitit's result timeout, and reported with its exit status and the
tail of its log instead of a bare submitit traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

import submitit

from ftexp.config import LauncherKind
from ftexp.job import JobSpec
from ftexp.launch.progress import SideProgress
from ftexp.rundir import BASELINE
from ftexp.trainer.baseline import run_baseline
from ftexp.trainer.driver import run_ft_driver

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 25
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


class JobFailed(RuntimeError):
    """A training job ended without a result; the message carries the log tail."""


def train_side(spec: JobSpec) -> str:
    """The job body: run one side of one phase to completion."""
    log_path = spec.side_dir.train_log
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)  # fd-level, so child processes inherit it
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control-API poll otherwise
    log.info("training %s%s: rollouts %s", spec.side, f"/{spec.phase}" if spec.phase else "", list(spec.rollout_ids()))
    if spec.side == BASELINE:
        run_baseline(spec)
    else:
        run_ft_driver(spec)
    log.info("done")
    return str(spec.side_dir.root)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _last_error_line(path: Path) -> str:
    """The final ``SomeError: message`` line of a traceback in the log, if there is one."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((ln.strip() for ln in reversed(lines) if _ERROR_LINE.match(ln.strip())), "see the log")


def make_executor(folder: Path, launcher_cfg) -> submitit.Executor:
    if launcher_cfg.name == LauncherKind.local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=launcher_cfg.timeout_min)
        return executor
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    options = {"partition": launcher_cfg.partition, "account": launcher_cfg.account,
               "cpus_per_task": launcher_cfg.cpus_per_task, "gpus_per_node": launcher_cfg.gpus_per_node}
    executor.update_parameters(time=launcher_cfg.timeout_min, nodes=launcher_cfg.nodes, job_name="ftexp",
                               additional_parameters=dict(launcher_cfg.additional_parameters),
                               **{k: v for k, v in options.items() if v is not None})
    return executor


def wait_for(job: submitit.Job, poll_interval_s: float, on_poll=lambda: None) -> None:
    while not job.done():
        on_poll()
        time.sleep(poll_interval_s)
    on_poll()


def job_failure(job: submitit.Job, log_path: Path) -> str | None:
    """None if the job returned normally; else why it did not, with the tail of its log."""
    if job.paths.result_pickle.exists():
        try:
            job.result()
            return None
        except Exception:  # the job raised: its traceback is in the log
            reason = f"failed: {_last_error_line(log_path)}"
    else:
        process = getattr(job, "_process", None)  # LocalJob: the job's controller process
        code = process.returncode if process is not None else job.state
        reason = f"died without a result (exit status {code})"
    return f"{reason}; last lines of {log_path}:\n{log_tail(log_path)}"


def run_side_job(spec: JobSpec, launcher_cfg, on_poll=lambda: None) -> None:
    """Submit the side's training job and block until it ends; raise JobFailed if it did not succeed."""
    spec.side_dir.root.mkdir(parents=True, exist_ok=True)
    executor = make_executor(spec.side_dir.submitit, launcher_cfg)
    # Inside a Slurm job (a sweep point), the inherited SLURM_* variables would make submitit take
    # the new job for the enclosing one; clean_env hides them while submitting.
    with submitit.helpers.clean_env():
        job = executor.submit(train_side, spec)
    where = f"{spec.side}{'/' + spec.phase if spec.phase else ''}"
    log.info("%s: submitted job %s (log: %s)", where, job.job_id, spec.side_dir.train_log)
    with SideProgress(where, spec) as progress:
        wait_for(job, launcher_cfg.poll_interval_s, lambda: (progress.update(), on_poll()))
    failure = job_failure(job, spec.side_dir.train_log)
    if failure:
        raise JobFailed(f"training job {where} {failure}")
