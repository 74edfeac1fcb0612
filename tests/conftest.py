import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_ftexp(*overrides: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run ``python -m ftexp`` as a user would; the caller asserts on the exit code and output."""
    return subprocess.run([sys.executable, "-m", "ftexp", *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture
def ftexp_cli():
    return run_ftexp
