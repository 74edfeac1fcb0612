"""Training jobs through submitit: one job per (side, phase).

``run_side_job(spec, launcher)`` submits :func:`train_side` and waits for it. The job's stdout
and stderr — including every Ray worker's and every DP rank's output — land in
``<side_dir>/train.log``. A job that dies hard (``os._exit``, SIGKILL) is detected as soon as
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

from ftexp.trainer.side import BASELINE, SideSpec

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 25
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


class JobFailed(RuntimeError):
    """A training job ended without a result; the message carries the log tail."""


def train_side(spec: SideSpec) -> str:
    """The job body: run one side of one phase to completion."""
    log_path = spec.side_dir / "train.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)  # fd-level, so child processes inherit it
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    log.info("training %s%s: rollouts %s", spec.side, f"/{spec.phase}" if spec.phase else "", list(spec.rollout_ids()))
    if spec.side == BASELINE:
        from ftexp.trainer.plain_dp import run_plain_dp
        run_plain_dp(spec)
    else:
        from ftexp.trainer.driver import run_ft_driver
        run_ft_driver(spec)
    log.info("done")
    return str(spec.side_dir)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _last_error_line(path: Path) -> str:
    """The final ``SomeError: message`` line of a traceback in the log, if there is one."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((ln.strip() for ln in reversed(lines) if _ERROR_LINE.match(ln.strip())), "see the log")


def make_executor(folder: Path, launcher_cfg) -> submitit.Executor:
    if launcher_cfg.name != "local":
        raise ValueError(f"unknown launcher {launcher_cfg.name!r}")
    executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(timeout_min=launcher_cfg.timeout_min)
    return executor


def run_side_job(spec: SideSpec, launcher_cfg) -> None:
    """Submit the side's training job and block until it ends; raise JobFailed if it did not succeed."""
    spec.side_dir.mkdir(parents=True, exist_ok=True)
    executor = make_executor(spec.side_dir / "submitit", launcher_cfg)
    job = executor.submit(train_side, spec)
    where = f"{spec.side}{'/' + spec.phase if spec.phase else ''}"
    log.info("%s: submitted job %s (log: %s)", where, job.job_id, spec.side_dir / "train.log")
    while not job.done():
        time.sleep(launcher_cfg.poll_interval_s)
    if job.paths.result_pickle.exists():
        try:
            job.result()
            return
        except Exception:  # the job raised: its traceback is in the log
            reason = f"failed: {_last_error_line(spec.side_dir / 'train.log')}"
    else:
        process = getattr(job, "_process", None)
        code = process.returncode if process is not None else None
        reason = f"died without a result (exit status {code})"
    raise JobFailed(f"training job {where} {reason}; last lines of {spec.side_dir / 'train.log'}:\n"
                    f"{log_tail(spec.side_dir / 'train.log')}")
