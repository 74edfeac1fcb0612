"""deterministic: heals on a cold start and after a resume, and every bit must match plain DP.

The run uses fixed-order reductions and deterministic kernels (``scenario.deterministic``); the
stock thresholds then demand ``rel <= 0`` and exact metrics, so any change in summation order or
any state a heal fails to carry shows.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.faults.plan import FaultPlan, TestActionKind
from ftexp.scenarios.base import Kind
from ftexp.scenarios.comparison import verify_phases
from ftexp.verify.report import CheckResult

KIND = Kind.comparison


def check_plan(cfg: ExperimentConfig) -> None:
    if not cfg.scenario.deterministic:
        raise InputError(f"scenario {cfg.scenario.name}: a deterministic scenario needs scenario.deterministic=true")
    n = cfg.mode.num_cells
    if not any(FaultPlan(p.target_actions, n).of_kind(TestActionKind.start_cell_at_end) for p in cfg.scenario.phases):
        raise InputError(f"scenario {cfg.scenario.name}: no start_cell_at_end action, so no heal would be compared")


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    return verify_phases(cfg, run_dir)
