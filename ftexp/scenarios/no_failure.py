"""no_failure: the target's cells train while nothing fails, and must match plain DP."""

from __future__ import annotations

from pathlib import Path

from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.scenarios.base import Kind
from ftexp.scenarios.comparison import verify_phases
from ftexp.verify.report import CheckResult

KIND = Kind.comparison


def check_plan(cfg: ExperimentConfig) -> None:
    """Nothing may be planned to fail: the run would prove something other than its name says."""
    planned = [p.name or "(the phase)" for p in cfg.scenario.phases if p.target_actions]
    if planned:
        raise InputError(f"scenario {cfg.scenario.name}: a no_failure scenario plans no faults, "
                         f"but {', '.join(planned)} has target_actions")


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    return verify_phases(cfg, run_dir)
