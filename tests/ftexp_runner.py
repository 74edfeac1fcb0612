"""Run ``python -m ftexp`` as a user would; tests assert on the exit code, output and run dir."""

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def run_ftexp(*overrides: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftexp", *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


class ForkedCli:
    """``python -m ftexp`` for many short runs (bad input, compare only), each a fork of one server that
    imported the CLI once (``cli_fork_server``), with :func:`run_ftexp`'s result. The server ends with
    :meth:`close`."""

    def __init__(self) -> None:
        self.outputs = Path(tempfile.mkdtemp(prefix="ftexp_cli_"))
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_fork_server.py"))],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def run(self, *overrides: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        stdout, stderr = self.outputs / "stdout", self.outputs / "stderr"
        request = {"argv": list(overrides), "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        if not select.select([self.server.stdout], [], [], timeout)[0]:
            self.server.kill()
            raise subprocess.TimeoutExpired(["ftexp", *overrides], timeout)
        returncode = json.loads(self.server.stdout.readline())["returncode"]
        return subprocess.CompletedProcess([sys.executable, "-m", "ftexp", *overrides], returncode,
                                           stdout.read_text(), stderr.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)
        shutil.rmtree(self.outputs)


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
