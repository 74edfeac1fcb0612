"""Run ``python -m ftexp`` as a user would; tests assert on the exit code, output and run dir."""

import os
import subprocess
import sys
from pathlib import Path


def run_ftexp(*overrides: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftexp", *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
