"""Cancelling a local job ends every process it started, by PID; a Slurm launcher that cannot be reached is refused.

The job here is a real submitit LocalExecutor job whose body starts what a training job starts: a
child in its own process group (as Ray starts its workers) and an orphan whose parent exited (as a
forkserver outlives the rank that started it), so neither the job's process group nor its process
tree alone reaches them.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import submitit

from ftexp.config import LauncherConfig, LauncherKind
from ftexp.errors import InputError
from ftexp.launch.jobs import JOB_TOKEN_ENV, bad_input_in_log, cancel_job, check_launcher, submit

import psutil  # noqa: E402  (ftexp.launch.jobs imported Ray, which ships psutil)

_BODY = r"""
import json, os, subprocess, sys, time
out = sys.argv[1]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
own_group = subprocess.Popen(sleeper, start_new_session=True)
parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; q = subprocess.Popen(%r); print(q.pid, flush=True)" % sleeper],
                          stdout=subprocess.PIPE, text=True)
orphan = int(parent.stdout.readline())
parent.wait()
with open(out + ".tmp", "w") as f:
    json.dump({"body": os.getpid(), "own_group": own_group.pid, "orphan": orphan}, f)
os.replace(out + ".tmp", out)
time.sleep(600)
"""


def _sigint_ignored(pid: int) -> bool:
    mask = next(int(ln.split()[1], 16) for ln in open(f"/proc/{pid}/status") if ln.startswith("SigIgn:"))
    return bool(mask & (1 << (2 - 1)))


def test_cancel_ends_the_whole_job_including_other_groups_and_orphans(tmp_path):
    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=5)
    pids_file = tmp_path / "pids.json"
    job, processes = submit(executor, subprocess.call, [sys.executable, "-c", _BODY, str(pids_file)])
    assert processes is not None and JOB_TOKEN_ENV not in os.environ  # the token lived only while submitting
    deadline = time.monotonic() + 120
    while not pids_file.exists():
        assert time.monotonic() < deadline and not job.done(), "the job did not start its processes"
        time.sleep(0.2)
    processes.refresh()  # as run_side_job's poll does
    started = json.loads(pids_file.read_text())
    tracked = {p.pid for p in processes.alive()}
    assert set(started.values()) <= tracked
    assert psutil.Process(started["orphan"]).ppid() != started["body"]  # re-parented: found by its token
    assert _sigint_ignored(job._process.pid) and _sigint_ignored(started["body"])  # a terminal's Ctrl-C is ours

    text = cancel_job(job, processes)

    assert text.startswith(f"cancelled job {job.job_id} and ended its ")
    time.sleep(0.5)
    survivors = [pid for pid in tracked if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert survivors == []
    assert processes.alive() == []


def _fake_slurm(tmp_path, sinfo_script: str | None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"sbatch": "#!/bin/sh\nexit 1\n"}
    if sinfo_script is not None:
        tools["sinfo"] = sinfo_script
    for name, script in tools.items():
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def test_slurm_without_a_reachable_controller_is_bad_input(tmp_path, monkeypatch):
    slurm = LauncherConfig(name=LauncherKind.slurm)
    unreachable = "#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n"
    monkeypatch.setenv("PATH", _fake_slurm(tmp_path, unreachable))
    with pytest.raises(InputError, match=r"no reachable Slurm controller: slurm_load_partitions: Unable to contact"):
        check_launcher(slurm)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(InputError, match="sbatch is not on PATH"):
        check_launcher(slurm)
    check_launcher(LauncherConfig(name=LauncherKind.local))  # nothing to reach


def test_a_job_that_failed_on_bad_input_is_found_in_its_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("\n".join([
        "[12:00:00] ftexp.trainer.driver: starting",
        "ray.exceptions.RayTaskError(RunDirError): ray::RankHost.init() (pid=1, ip=127.0.0.1)",
        "  File \"/x/checkpoint.py\", line 55, in load_rank_state",
        "ftexp.errors.RunDirError: corrupt checkpoint file /r/target/phase_a/ckpt/iter_0000001/state.pt: "
        "UnpicklingError: invalid load key, 'x'.",
        "Traceback (most recent call last):",
        "RuntimeError: the group could not start",
    ]))
    assert bad_input_in_log(log) == ("corrupt checkpoint file /r/target/phase_a/ckpt/iter_0000001/state.pt: "
                                     "UnpicklingError: invalid load key, 'x'.")
    log.write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
    assert bad_input_in_log(log) is None
    assert bad_input_in_log(tmp_path / "missing.log") is None
