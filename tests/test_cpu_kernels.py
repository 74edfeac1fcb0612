"""Every ftexp process computes with the same CPU kernels (AVX2 on x86), unless the user picked others."""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")
PROBE = "import ftexp, torch; print(torch.backends.cpu.get_cpu_capability())"


def _capability(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    return subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_ftexp_processes_use_avx2_kernels():
    assert _capability() == "AVX2"


def test_a_users_choice_wins():
    assert _capability(ATEN_CPU_CAPABILITY="default") == "DEFAULT"
