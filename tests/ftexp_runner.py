"""Run ``python -m ftexp`` as a user would; tests assert on the exit code, output and run dir.

``run_ftexp`` runs ``ftexp.cli.main`` — what ``python -m ftexp`` runs — in a process of its own, with
its own cwd, environment, output files and exit code, forked from the test process's preloaded fork
server (``preloaded_forks``): a fresh interpreter would first spend ~3.5 CPU-s importing the CLI
(torch, Hydra, Ray, the trainer) on every command line. Every job, rank and engine the run starts is
a fresh process, as in a user's run. The tests that watch a run's process tree or signal it, and the
sweeps and the wheel, start ``python -m ftexp`` itself.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from preloaded_forks import forkserver_context

import ftexp.cli


def _cli_main(argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """``python -m ftexp`` with ``argv`` in ``cwd`` and ``env``, its output in the files ``stdout`` and ``stderr``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        file_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file_fd, fd)
        os.close(file_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = ["ftexp", *argv]
    ftexp.cli.main()  # its SystemExit becomes the process's exit code, as in the interpreter


def run_ftexp(*overrides: str, cwd: Path, timeout: float = 900, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    """``python -m ftexp *overrides`` in ``cwd`` with this process's environment updated by ``env``; killed
    after ``timeout`` s."""
    with tempfile.TemporaryDirectory(prefix="ftexp_cli_") as outputs:
        stdout, stderr = Path(outputs, "stdout"), Path(outputs, "stderr")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = forkserver_context().Process(target=_cli_main,
                                            args=(list(overrides), str(cwd), env, str(stdout), str(stderr)))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["ftexp", *overrides], timeout)
        return subprocess.CompletedProcess([sys.executable, "-m", "ftexp", *overrides], proc.exitcode,
                                           stdout.read_text(), stderr.read_text())


def report_checks(run_dir: Path) -> dict[str, dict]:
    """The run's report.json checks by name."""
    return {c["name"]: c for c in json.loads((run_dir / "report.json").read_text())["checks"]}


def assert_passed(run_dir: Path, result: subprocess.CompletedProcess) -> dict[str, dict]:
    """Exit 0 and every check of the report passed; the checks by name."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checks = report_checks(run_dir)
    assert all(c["passed"] for c in checks.values()), [c["summary"] for c in checks.values() if not c["passed"]]
    return checks


def run_named(root: Path, name: str, *overrides: str, timeout: float = 1500) -> tuple[Path, subprocess.CompletedProcess]:
    """A run in ``root/name``; its run dir and the finished process."""
    run_dir = root / name
    return run_dir, run_ftexp(*overrides, f"hydra.run.dir={run_dir}", cwd=root, timeout=timeout)
