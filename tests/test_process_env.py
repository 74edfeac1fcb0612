"""The process-wide settings every ftexp process gets from importing ``ftexp``, unless the user made them."""

import os
import platform
import subprocess
import sys

import pytest

on_x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 only")
KERNELS = "import ftexp, torch; print(torch.backends.cpu.get_cpu_capability())"
MKL_PATH = "import ftexp, os; print(os.environ['MKL_CBWR'])"
USAGE_STATS = "import ftexp; from ray._common.usage.usage_lib import usage_stats_enabled; print(usage_stats_enabled())"


def _run(probe: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "RAY_USAGE_STATS_ENABLED")}
    return subprocess.run([sys.executable, "-c", probe], env={**clean, **env}, capture_output=True, text=True,
                          check=True).stdout.strip()


@on_x86
def test_ftexp_processes_use_avx2_kernels():
    assert _run(KERNELS) == "AVX2"


@on_x86
def test_a_users_kernels_win():
    assert _run(KERNELS, ATEN_CPU_CAPABILITY="default") == "DEFAULT"


@on_x86
def test_ftexp_processes_pin_mkl_to_its_avx2_path():
    assert _run(MKL_PATH) == "AVX2"


def test_ray_collects_no_usage_stats():
    """With them on, Ray's dashboard process probes the cloud metadata address, off loopback."""
    assert _run(USAGE_STATS) == "False"
