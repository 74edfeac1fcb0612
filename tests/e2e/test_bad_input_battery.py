"""Bad input and interrupts, run as a user would, on copies of one passing ``mode=dp2 scenario=no_failure`` run.

Each case must exit 2 (bad input) or 130 (SIGINT/SIGTERM) with exactly one line on stderr (no
traceback), and leave no file anywhere in the run dir that says PASSED: the verdict files say
ERROR or INTERRUPTED instead. An interrupted run must also leave no process behind: every process
of the run (marked by an environment variable all of them inherit, Ray workers included) is gone
10 s after the signal.

Where the tests run as root, who may read and write anything, the permission cases run the command
line without the capabilities that let root ignore file permissions.
"""

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from ftexp_runner import run_ftexp

import ray  # noqa: F401  (Ray ships psutil and puts it on sys.path)
import psutil  # noqa: E402

pytestmark = pytest.mark.e2e
MARK = "FTEXP_BATTERY_MARK"
VERDICT_FILES = ("report.md", "report.json", "result.json")


@pytest.fixture(scope="module")
def passing_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("battery")
    run_dir = root / "passing"
    result = run_ftexp("mode=dp2", "scenario=no_failure", f"hydra.run.dir={run_dir}", cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (run_dir / "report.md").read_text().startswith("# ftexp verdict: PASSED")
    return run_dir


def _copy(passing_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(passing_run, run_dir)
    return run_dir


def _status(path: Path) -> str:
    if path.name == "report.md":
        return path.read_text().splitlines()[0].removeprefix("# ftexp verdict: ")
    data = json.loads(path.read_text())
    return "PASSED" if data.get("passed") is True else data.get("status", "FAILED")


def assert_no_pass_anywhere(run_dir: Path, status: str) -> None:
    claims = [p for p in run_dir.rglob("*") if p.name in VERDICT_FILES and _status(p) == "PASSED"]
    assert claims == [], f"still PASSED: {claims}"
    assert {name: _status(run_dir / name) for name in VERDICT_FILES} == {name: status for name in VERDICT_FILES}


def assert_one_line(result, code: int, *fragments: str) -> str:
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("ftexp: "), result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _compare(run_dir: Path, *extra: str, preexec=None):
    return _ftexp("mode=dp2", "scenario=no_failure", "stage=compare", f"run_dir={run_dir}", *extra,
                  cwd=run_dir.parent, preexec=preexec)


def _ftexp(*overrides: str, cwd: Path, preexec=None, env=None, timeout: float = 600):
    """The command line, forked from the preloaded server; with ``preexec`` (which takes effect at an exec),
    ``python -m ftexp`` itself."""
    if preexec is None:
        return run_ftexp(*overrides, cwd=cwd, timeout=timeout, env=env)
    return subprocess.run([sys.executable, "-m", "ftexp", *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _target_grad(run_dir: Path) -> Path:
    leaf = run_dir / "target" / "dumps" / "fwd_bwd" / "rollout_1"
    return next(leaf.glob("*name=grad__layers.0.mlp.fc1.weight___*.pt"))


def _cut_line(path: Path, index: int) -> None:
    lines = path.read_text().splitlines()
    lines[index] = lines[index][: len(lines[index]) // 2]
    path.write_text("\n".join(lines) + "\n")


# ---- damaged files, re-checked with stage=compare ------------------------------------------------

@pytest.mark.parametrize("damage, fragments", [
    (lambda r: _target_grad(r).write_bytes(b"garbage\n"), ["corrupt dump file", "grad__layers.0.mlp.fc1.weight"]),
    (lambda r: _target_grad(r).write_bytes(_target_grad(r).read_bytes()[:200]), ["corrupt dump file", "rollout_1"]),
    (lambda r: _cut_line(r / "target" / "events" / "main.jsonl", 2), ["target/events/main.jsonl:3: not a valid event"]),
    (lambda r: _cut_line(r / "target" / "metrics.jsonl", 1), ["target/metrics.jsonl:2: not a valid metrics line"]),
    (lambda r: shutil.rmtree(r / "target"), ["holds no baseline/ and target/"]),
], ids=["dump-garbage", "dump-truncated", "event-truncated", "metrics-truncated", "target-missing"])
def test_damaged_run_dir_is_bad_input_and_takes_back_the_pass(passing_run, tmp_path, damage, fragments):
    run_dir = _copy(passing_run, tmp_path)
    damage(run_dir)
    assert_one_line(_compare(run_dir), 2, *fragments)
    assert_no_pass_anywhere(run_dir, "ERROR")
    assert not (run_dir / "curves.png").exists()
    assert fragments[0] in json.loads((run_dir / "result.json").read_text())["cause"]


# ---- permissions ---------------------------------------------------------------------------------

_PR_CAPBSET_DROP = 24
_DAC_CAPS = (1, 2, 3)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER


def _as_a_user():
    """A preexec_fn that makes root subject to file permissions in the command it runs (None if not root)."""
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        for cap in _DAC_CAPS:  # out of the bounding set: exec then leaves root without them
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                os._exit(97)

    return drop


@pytest.fixture
def as_a_user(tmp_path):
    preexec = _as_a_user()
    probe = tmp_path / "probe"
    probe.mkdir(mode=0o555)
    try:
        check = subprocess.run([sys.executable, "-c", f"import os; print(os.access({str(probe)!r}, os.W_OK))"],
                               capture_output=True, text=True, preexec_fn=preexec, timeout=60)
    finally:
        probe.chmod(0o755)
    if check.returncode != 0 or check.stdout.strip() != "False":
        pytest.skip("cannot run the command line subject to file permissions here")
    return preexec


def test_unreadable_dump_is_bad_input(passing_run, tmp_path, as_a_user):
    run_dir = _copy(passing_run, tmp_path)
    victim = _target_grad(run_dir)
    victim.chmod(0)
    try:
        assert_one_line(_compare(run_dir, preexec=as_a_user), 2, "cannot read dump file", victim.name, "Permission denied")
    finally:
        victim.chmod(0o644)
    assert_no_pass_anywhere(run_dir, "ERROR")


def test_unwritable_run_dir_is_bad_input_and_its_pass_is_taken_back_in_place(passing_run, tmp_path, as_a_user):
    run_dir = _copy(passing_run, tmp_path)
    for name in VERDICT_FILES:
        (run_dir / name).chmod(0o644)
    run_dir.chmod(0o555)
    try:
        assert_one_line(_compare(run_dir, preexec=as_a_user), 2, f"run dir {run_dir} is not writable")
    finally:
        run_dir.chmod(0o755)
    assert_no_pass_anywhere(run_dir, "ERROR")


def test_unwritable_output_dir_is_refused_before_anything_starts(tmp_path, as_a_user):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        result = _ftexp("mode=dp2", f"hydra.run.dir={locked}/run", cwd=tmp_path, preexec=as_a_user, timeout=300)
        assert_one_line(result, 2, f"{locked}/run is not writable")
    finally:
        locked.chmod(0o755)
    assert list(locked.iterdir()) == []


# ---- inputs of a training stage ------------------------------------------------------------------

def test_corrupt_rollout_data_is_refused_before_any_job(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    (run_dir / "rollout_data" / "1.pt").write_bytes(b"garbage")
    result = _ftexp("mode=dp2", "scenario=no_failure", "stage=target", f"run_dir={run_dir}", cwd=tmp_path)
    assert_one_line(result, 2, "corrupt rollout file", "rollout_data/1.pt")
    assert_no_pass_anywhere(run_dir, "ERROR")
    assert (run_dir / "target" / "dumps").is_dir()  # nothing was launched: a job starts from an emptied side dir


def test_missing_checkpoint_of_a_resumed_phase(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    result = _ftexp("mode=dp2", "scenario=with_failure", "stage=target", "phase=phase_b", f"run_dir={run_dir}",
                    cwd=tmp_path)
    assert_one_line(result, 2, "target/phase_b resumes from target/phase_a", "missing checkpoint tracker")
    assert_no_pass_anywhere(run_dir, "ERROR")


def test_corrupt_checkpoint_of_a_resumed_phase(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    for side in ("baseline", "target"):
        ckpt = run_dir / side / "phase_a" / "ckpt"
        (ckpt / "iter_0000001").mkdir(parents=True)
        torch.save({"w": torch.ones(2)}, ckpt / "iter_0000001" / "state_pp0_tp0_cp0_ep0.pt")
        (ckpt / "latest_checkpointed_iteration.txt").write_text("1\n")
    state = run_dir / "target" / "phase_a" / "ckpt" / "iter_0000001" / "state_pp0_tp0_cp0_ep0.pt"
    state.write_bytes(state.read_bytes()[:64])
    result = _ftexp("mode=dp2", "scenario=with_failure", "stage=run", "phase=phase_b", f"run_dir={run_dir}",
                    cwd=tmp_path)
    assert_one_line(result, 2, "corrupt checkpoint file", str(state.relative_to(tmp_path)))
    assert_no_pass_anywhere(run_dir, "ERROR")


def test_slurm_without_a_reachable_controller(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    env = {}
    if shutil.which("sinfo"):  # a Slurm client: point it at a controller that is not there (127.0.0.1, port 9)
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
                        "MessageTimeout=1\nTCPTimeout=1\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
                        "PartitionName=debug Nodes=localhost Default=YES\n")
        env["SLURM_CONF"] = str(conf)
    result = _ftexp("mode=dp2", "scenario=no_failure", "launcher=slurm", f"run_dir={run_dir}", cwd=tmp_path, env=env)
    assert_one_line(result, 2, "launcher=slurm")
    assert_no_pass_anywhere(run_dir, "ERROR")


# ---- interrupts ----------------------------------------------------------------------------------

def _marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


# The interrupted side trains more rollouts than the copied run's two (the rest are recorded first), so
# that the signal, sent once it has committed its first rollout, lands while it trains and not after it
# finished.
LONGER = ("scenario.num_rollout=40",)


@contextlib.contextmanager
def _sigint_not_ignored():
    """Children started meanwhile get the default SIGINT, as a program in a terminal's foreground does.

    A shell starts its background jobs (``.ci/run ... &``) with SIGINT ignored, every process below
    inherits that, and a program that finds SIGINT ignored rightly leaves it so: the CLI under test
    would never see the Ctrl-C. A handler (unlike "ignore") is not inherited, so the child starts
    with the default."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt(run_dir: Path, overrides: list[str], ready: Path, sig: int, to_group: bool):
    """Start a run, wait until ``ready`` exists, signal it; return (result, the names of its processes
    when signalled, those still running 10 s later)."""
    mark = uuid.uuid4().hex
    with _sigint_not_ignored():
        proc = subprocess.Popen([sys.executable, "-m", "ftexp", *overrides], cwd=run_dir.parent, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", MARK: mark})
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                out, err = proc.communicate()
                pytest.fail(f"the run ended or hung before {ready} appeared:\n{out[-2000:]}\n{err[-2000:]}")
            time.sleep(0.2)
        seen = [p.name() for p in _marked(mark)]
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=60)
        survivors = _marked(mark)
        while survivors and time.monotonic() - signalled < 10:
            time.sleep(0.5)
            survivors = _marked(mark)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen, survivors
    finally:
        for leftover in _marked(mark):  # never leak a failing test's processes into the next one
            leftover.kill()


def test_ctrl_c_during_target_cancels_the_job_and_ends_ray(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    shutil.rmtree(run_dir / "target")  # retrained here; its first metrics tell us the cells train
    result, seen, survivors = _interrupt(
        run_dir, ["mode=dp2", "scenario=no_failure", *LONGER, "stage=target", f"run_dir={run_dir}"],
        run_dir / "target" / "metrics.jsonl", signal.SIGINT, to_group=True)
    assert {"raylet", "gcs_server"} <= set(seen), seen  # Ray was up when the terminal's Ctrl-C came
    line = assert_one_line(result, 130, "interrupted by SIGINT during target; cancelled job", "marked INTERRUPTED")
    assert survivors == [], f"{line}; still running 10 s later: {survivors}"
    assert_no_pass_anywhere(run_dir, "INTERRUPTED")
    assert "cancelled job" in (run_dir / "report.md").read_text()


def test_sigterm_during_baseline_cancels_the_job(passing_run, tmp_path):
    run_dir = _copy(passing_run, tmp_path)
    shutil.rmtree(run_dir / "baseline")
    result, seen, survivors = _interrupt(
        run_dir, ["mode=dp2", "scenario=no_failure", *LONGER, "stage=baseline", f"run_dir={run_dir}"],
        run_dir / "baseline" / "events" / "dp_rank1.jsonl", signal.SIGTERM, to_group=False)
    assert len(seen) >= 4, seen  # the CLI, submitit's controller, the job, its ranks
    assert_one_line(result, 130, "interrupted by SIGTERM during baseline; cancelled job")
    assert survivors == [], survivors
    assert_no_pass_anywhere(run_dir, "INTERRUPTED")
