"""Training jobs through submitit: one job per (side, phase).

``run_side_job(spec, launcher)`` submits (locally or to Slurm) :func:`train_side` and waits for it. The job's stdout
and stderr — including every Ray worker's and every DP rank's output — land in
the side's ``train.log``. A job that dies hard (``os._exit``, SIGKILL) is detected as soon as
its process ends, not after submitit's result timeout, and reported with its exit status and the
tail of its log instead of a bare submitit traceback. A job that failed on bad input (an unreadable
checkpoint or rollout file) is bad input here too: InputError, one line.

A local job is a process tree: submitit's controller, the job (the Ray driver or the baseline's
launcher), gcs/raylet and Ray workers (each in its own process group), gloo ranks and their
forkserver. ``JobProcesses`` remembers every process of that tree while the job runs (a process
whose parent died is re-parented and would drop out of the tree) and, with the environment token
every process of the job inherits, finds them all again to end them. On SIGINT/SIGTERM (or any
error) while waiting, the job is cancelled — its processes ended by PID, a Slurm job scancel'ed — and
``Interrupted`` says what was stopped and what was cleaned up. The jobs are started with SIGINT
ignored, so a Ctrl-C in the terminal reaches only this process, which does the cleaning up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import ray  # noqa: F401  (Ray ships psutil in its thirdparty_files and puts that on sys.path)
import psutil  # noqa: E402
import submitit
import torch

from ftexp.config import LauncherKind
from ftexp.environment import environment_set
from ftexp.errors import InputError, Interrupted, interrupt_signal, one_line
from ftexp.job import JobSpec
from ftexp.launch.multinode import run_on_node
from ftexp.launch.progress import SideProgress
from ftexp.rundir import BASELINE
from ftexp.trainer.baseline import run_baseline
from ftexp.trainer.checkpoint import check_resumable
from ftexp.trainer.driver import run_ft_driver

log = logging.getLogger(__name__)
LOG_TAIL_LINES = 25
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")
# The job raised bad input (ftexp.errors.InputError or RunDirError, possibly inside a Ray task error).
_BAD_INPUT_LINE = re.compile(r"^(?:ftexp\.errors\.)?(?:InputError|RunDirError): (.+)$")
# Every process of a local job inherits this variable (submitit copies the environment at submit).
JOB_TOKEN_ENV = "FTEXP_JOB_TOKEN"
TERM_GRACE_S = 3.0


class JobFailed(RuntimeError):
    """A training job ended without a result; the message carries the log tail."""


# ---- signals -------------------------------------------------------------------------------------


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def children_ignore_sigint():
    """Start processes with SIGINT ignored (an ignored disposition survives exec; Python keeps it):
    a terminal's Ctrl-C then reaches only this process, which cancels the job in order, instead of
    every process of the job printing its own KeyboardInterrupt."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def signals_deferred():
    """While cleaning up after an interrupt, a second Ctrl-C or SIGTERM must not cut the cleanup short."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ---- the processes of a local job ----------------------------------------------------------------


def _token_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(JOB_TOKEN_ENV)
    except (psutil.Error, OSError):
        return None


def _children_by_parent() -> dict[int, list[int]]:
    """Parent PID -> child PIDs, from one read of every ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    return children


class JobProcesses:
    """Every process of one local job, by PID: its controller's tree as seen while it ran, plus
    any process that carries the job's environment token."""

    def __init__(self, root_pid: int, token: str) -> None:
        self.root_pid, self.token = root_pid, token
        self._known: dict[int, psutil.Process] = {}
        self.refresh()

    def refresh(self) -> None:
        """Add every descendant of the controller and of every process already known.

        One pass over the machine's process table per call (``Process.children`` would make one per
        root, and a job has dozens of processes)."""
        children = _children_by_parent()
        pending = [self.root_pid, *self._known]
        while pending:
            for pid in children.get(pending.pop(), []):
                if pid not in self._known:
                    with contextlib.suppress(psutil.Error):
                        self._known[pid] = psutil.Process(pid)
                        pending.append(pid)
        if self.root_pid not in self._known:
            with contextlib.suppress(psutil.Error):
                self._known[self.root_pid] = psutil.Process(self.root_pid)

    def _with_token(self) -> list[psutil.Process]:
        me = os.getpid()
        return [p for p in psutil.process_iter() if p.pid != me and _token_of(p) == self.token]

    def alive(self) -> list[psutil.Process]:
        self.refresh()
        for proc in self._with_token():
            self._known.setdefault(proc.pid, proc)
        out = []
        for proc in self._known.values():
            try:  # is_running() also tells a reused PID from the process we saw
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except psutil.Error:
                pass
        return out

    def end(self, grace_s: float = TERM_GRACE_S) -> int:
        """SIGTERM every process, SIGKILL what is left after ``grace_s``; the number that were running."""
        procs = self.alive()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        psutil.wait_procs(procs, timeout=grace_s)
        for _ in range(5):  # a dying parent may have started a child meanwhile: look again
            left = self.alive()
            if not left:
                break
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(left, timeout=2.0)
        return len(procs)


def cancel_job(job: submitit.Job, processes: JobProcesses | None) -> str:
    """End the job; what was done, for the one line the user reads."""
    if processes is not None:
        ended = processes.end()
        with contextlib.suppress(Exception):
            job._process.wait(timeout=1)  # reap the controller (LocalJob keeps it as its child)
        return f"cancelled job {job.job_id} and ended its {ended} process{'es' if ended != 1 else ''}"
    try:
        job.cancel(check=False)  # scancel
        return f"cancelled job {job.job_id} (scancel)"
    except Exception as e:
        return f"could not cancel job {job.job_id}: {one_line(e)}"


# ---- launcher reachability -----------------------------------------------------------------------


def check_launcher(launcher_cfg) -> None:
    """launcher=slurm needs a Slurm client on PATH and a controller that answers; else one line, exit 2."""
    if launcher_cfg.name != LauncherKind.slurm:
        return
    for tool in ("sbatch", "sinfo"):
        if shutil.which(tool) is None:
            raise InputError(f"launcher=slurm: {tool} is not on PATH (no Slurm client on this machine)")
    try:
        answer = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise InputError("launcher=slurm: no reachable Slurm controller (sinfo did not answer within 30 s)") from None
    if answer.returncode != 0:
        why = next((ln.strip() for ln in (answer.stderr + answer.stdout).splitlines() if ln.strip()),
                   f"sinfo exit status {answer.returncode}")
        raise InputError(f"launcher=slurm: no reachable Slurm controller: {why}")


def train_side(spec: JobSpec) -> str:
    """The job body: run one side of one phase to completion."""
    log_path = spec.side_dir.train_log
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1), os.dup2(fd, 2)  # fd-level, so child processes inherit it
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control-API poll otherwise
    torch.set_num_threads(1)  # the job orchestrates; the ranks it starts set their own threads
    log.info("training %s%s: rollouts %s", spec.side, f"/{spec.phase}" if spec.phase else "", list(spec.rollout_ids()))
    if spec.nodes > 1:  # this is one of the job's tasks, one per node
        run_on_node(spec)
    elif spec.side == BASELINE:
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


def bad_input_in_log(path: Path) -> str | None:
    """The message of the last InputError/RunDirError the job's log shows, if it shows one."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return next((m.group(1).strip() for ln in reversed(lines) if (m := _BAD_INPUT_LINE.match(ln.strip()))), None)


def make_executor(folder: Path, launcher_cfg, nodes: int = 1) -> submitit.Executor:
    """``nodes`` > 1 (Slurm only): one task per node, each running the job body (see ``ftexp.launch.multinode``)."""
    if launcher_cfg.name == LauncherKind.local:
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=launcher_cfg.timeout_min)
        return executor
    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
    options = {"partition": launcher_cfg.partition, "account": launcher_cfg.account,
               "cpus_per_task": launcher_cfg.cpus_per_task, "gpus_per_node": launcher_cfg.gpus_per_node}
    # Multi-node: a failed node must not end the job (sbatch and srun --no-kill); the driver shrinks instead.
    no_kill = {"srun_args": ["--no-kill"]} if nodes > 1 else {}
    executor.update_parameters(time=launcher_cfg.timeout_min, nodes=nodes, job_name="ftexp", **no_kill,
                               additional_parameters={**({"no_kill": True} if nodes > 1 else {}),
                                                      **launcher_cfg.additional_parameters},
                               **{k: v for k, v in options.items() if v is not None})
    return executor


def wait_for(job: submitit.Job, poll_interval_s: float, on_poll=lambda: None) -> None:
    while not job.done():
        on_poll()
        time.sleep(poll_interval_s)
    on_poll()


def job_failure(job: submitit.Job, log_path: Path) -> str | None:
    """None if the job returned normally; else why it did not, with the tail of its log."""
    job = job._sub_jobs[0] if getattr(job, "_sub_jobs", None) else job  # multi-node: task 0 (the head) decides
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


@contextlib.contextmanager
def job_token():
    """A fresh token in the environment while a job is submitted: every process of the job inherits it."""
    token = uuid.uuid4().hex
    with environment_set({JOB_TOKEN_ENV: token}):
        yield token


def submit(executor: submitit.Executor, fn, *args) -> tuple[submitit.Job, JobProcesses | None]:
    """Submit ``fn(*args)``; for a local job, also what it takes to end every process of it."""
    # Inside a Slurm job (a sweep point), the inherited SLURM_* variables would make submitit take
    # the new job for the enclosing one; clean_env hides them while submitting.
    try:
        with submitit.helpers.clean_env(), job_token() as token, children_ignore_sigint():
            job = executor.submit(fn, *args)
    except (OSError, subprocess.SubprocessError, submitit.core.utils.FailedJobError) as e:
        raise InputError(f"could not submit the training job: {one_line(e)}") from e
    local = isinstance(job, submitit.LocalJob) and getattr(job, "_process", None) is not None
    return job, JobProcesses(job._process.pid, token) if local else None


def run_side_job(spec: JobSpec, launcher_cfg, on_poll=lambda: None) -> None:
    """Submit the side's training job and block until it ends; raise JobFailed if it did not succeed,
    InputError if it failed on bad input, Interrupted (after cancelling it) on SIGINT/SIGTERM."""
    where = f"{spec.side}{'/' + spec.phase if spec.phase else ''}"
    if spec.load_dir is not None:
        check_resumable(spec.load_dir)  # a resumed phase needs its checkpoint: one line before any job starts
    spec.side_dir.root.mkdir(parents=True, exist_ok=True)
    executor = make_executor(spec.side_dir.submitit, launcher_cfg, nodes=spec.nodes)
    job, processes = submit(executor, train_side, spec)
    log.info("%s: submitted job %s (log: %s)", where, job.job_id, spec.side_dir.train_log)

    def poll() -> None:
        if processes is not None:
            processes.refresh()
        progress.update()
        on_poll()

    try:
        with SideProgress(where, spec) as progress:
            wait_for(job, launcher_cfg.poll_interval_s, poll)
    except BaseException as e:  # Ctrl-C, SIGTERM, or an error while waiting: the job must not outlive us
        with signals_deferred():
            cleaned = cancel_job(job, processes)
        if isinstance(e, KeyboardInterrupt):
            raise Interrupted(f"interrupted by {interrupt_signal(e)} during {where}; {cleaned}") from None
        log.error("%s: %s after %s", where, cleaned, one_line(e))
        raise
    failure = job_failure(job, spec.side_dir.train_log)
    if failure:
        bad_input = bad_input_in_log(spec.side_dir.train_log)
        if bad_input is not None:
            raise InputError(f"training job {where}: {bad_input}")
        raise JobFailed(f"training job {where} {failure}")
