"""with_failure: a cell crashes before the cross-cell reduce, the group shrinks, then heals it.

Positive proof that the fault happened and the heal ran: the crash's ``fault_injected`` event,
the shrink at the crash rollout and the heal after the cell is restarted, each naming the cells
the plan names (the crashed cell may be any one, so the survivor, the heal source and the cell
that logs may all change).
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
    """At least one crash, and the crashed cell restarted: otherwise there is no fault or no heal to prove."""
    n = cfg.mode.num_cells
    plans = [FaultPlan(p.target_actions, n) for p in cfg.scenario.phases]
    crashes = [a for plan in plans for a in plan.of_kind(TestActionKind.crash_before_allreduce)]
    restarts = {a.cell for plan in plans for a in plan.of_kind(TestActionKind.start_cell_at_end)}
    if not crashes:
        raise InputError(f"scenario {cfg.scenario.name}: a with_failure scenario needs a crash_before_allreduce action")
    if n < 2:
        raise InputError(f"scenario {cfg.scenario.name} needs >= 2 cells to shrink and heal (mode {cfg.mode.name} has {n})")
    unhealed = sorted({a.cell for a in crashes} - restarts)
    if unhealed:
        raise InputError(f"scenario {cfg.scenario.name}: crashed cell(s) {unhealed} are never started again "
                         f"(add a start_cell_at_end action), so no heal would be proven")


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    return verify_phases(cfg, run_dir)
