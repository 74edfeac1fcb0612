"""Non-blocking runs: ``launcher.wait=false`` submits the training as one job and returns at once.

The job trains every phase of both sides (submitting the per-side jobs itself) and leaves the
verdict to ``stage=collect run_dir=...``, which waits for the job, then verifies and reports.
``<run_dir>/submission.json`` records what was submitted, so collect can find it again from
any process (and, on Slurm, from any machine of the cluster).

The submitted job is detached: it ignores SIGINT (a later Ctrl-C in the terminal it came from does
not reach it), and a SIGTERM to it (``scancel``, ``kill``) cancels the side job it is waiting for,
whose processes end with it. A Ctrl-C during collect stops waiting, not the job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import submitit

from ftexp.config import LauncherKind
from ftexp.errors import InputError, Interrupted, interrupt_signal
from ftexp.launch.jobs import log_tail, make_executor, submit
from ftexp.launch.sides import train_sides
from ftexp.rundir import BASELINE, SUBMISSION, SUBMITIT_RUN, TARGET

log = logging.getLogger("ftexp")


def _sigterm_interrupts(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _train_all(cfg, run_dir: Path) -> str:
    """The job body: every side of every phase, as a foreground run would train them."""
    signal.signal(signal.SIGTERM, _sigterm_interrupts)  # cancelled: end the side job we wait for, too
    train_sides(cfg, run_dir, (BASELINE, TARGET), cfg.phase)
    return str(run_dir)


@contextlib.contextmanager
def _stdio_detached():
    """While submitting: the job inherits /dev/null, not our stdout/stderr. A job that held them would
    keep a caller's pipe open (``$(python -m ftexp ...)``, subprocess.run) until training ended."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1), os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def submit_run(cfg, run_dir: Path) -> str:
    """Submit the training of ``run_dir`` as one job; the nested side jobs wait inside it."""
    inner = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, wait=True))
    folder = run_dir / SUBMITIT_RUN
    # The run job waits for every side job of every phase in turn: give it their time limits together.
    outer = dataclasses.replace(cfg.launcher, timeout_min=cfg.launcher.timeout_min * (2 * len(cfg.scenario.phases) + 1))
    with _stdio_detached():
        job, _ = submit(make_executor(folder, outer), _train_all, inner, run_dir)
    (run_dir / SUBMISSION).write_text(json.dumps(
        {"job_id": job.job_id, "launcher": cfg.launcher.name.value, "folder": str(folder)}))
    return job.job_id


def _local_job_running(job_id: str) -> bool:
    """A LocalExecutor job id is its controller's pid; the controller outlives the submitter."""
    try:
        os.kill(int(job_id), 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{job_id}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def wait_for_submission(run_dir: Path, poll_interval_s: float) -> str | None:
    """Block until the submitted run ends; None if it trained everything, else why not."""
    path = run_dir / SUBMISSION
    if not path.is_file():
        raise InputError(f"{run_dir} has no {SUBMISSION}: it was not submitted with launcher.wait=false")
    try:
        sub = json.loads(path.read_text())
        job_id, kind, folder = sub["job_id"], LauncherKind(sub["launcher"]), Path(sub["folder"])
    except (ValueError, KeyError) as e:
        raise InputError(f"{path} is malformed: {e}") from None
    try:
        if kind == LauncherKind.slurm:
            job: submitit.Job = submitit.SlurmJob(folder=folder, job_id=job_id)
            while not job.done():
                time.sleep(poll_interval_s)
        else:
            job = submitit.LocalJob(folder=folder, job_id=job_id)
            while _local_job_running(job_id) and not job.paths.result_pickle.exists():
                time.sleep(poll_interval_s)
    except KeyboardInterrupt as e:
        raise Interrupted(f"interrupted by {interrupt_signal(e)} during collect; the submitted job {job_id} keeps "
                          f"running (collect again with stage=collect run_dir={run_dir})") from None
    log.info("submitted run %s (job %s) ended", run_dir, job_id)
    if job.paths.result_pickle.exists():
        try:
            job.result()
            return None
        except Exception as e:
            return f"the training job failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    return f"the training job {job_id} died without a result; its log:\n{log_tail(job.paths.stderr)}"
