"""node_failure: a whole node of a multi-node job is lost, every cell on it shrinks out at once, then heals.

Positive proof: the node fault's ``fault_injected`` event (naming the node), one shrink at the fault's
rollout that drops every cell the placement put on that node, and one heal of all of them after the
node is restored — derived from the plan and the placement like every comparison scenario's
expectations (``comparison.planned_reconfigures``). The recovery check reports detection (fault →
shrink) and, for the heal, how long the node was away and how long it took to rejoin.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.faults.plan import FaultPlan, TestActionKind
from ftexp.placement import placement_for
from ftexp.scenarios.base import Kind
from ftexp.scenarios.comparison import verify_phases
from ftexp.verify.report import CheckResult

KIND = Kind.comparison


def check_plan(cfg: ExperimentConfig) -> None:
    """A node fault, on a node whose cells leave survivors, and the node restored: else nothing to prove."""
    placement = placement_for(cfg)
    if placement is None:
        raise InputError(f"scenario {cfg.scenario.name} takes a node away: it needs launcher=slurm launcher.nodes>=2 "
                         f"(mode {cfg.mode.name} runs on one node here)")
    plans = [FaultPlan(p.target_actions, cfg.mode.num_cells, placement) for p in cfg.scenario.phases]
    kills = [a for plan in plans for a in plan.of_kind(TestActionKind.kill_node_before_allreduce)]
    restored = {a.node for plan in plans for a in plan.of_kind(TestActionKind.restore_node_at_end)}
    if not kills:
        raise InputError(f"scenario {cfg.scenario.name}: a node_failure scenario needs a kill_node_before_allreduce action")
    for kill in kills:
        if len(kill.cells) >= cfg.mode.num_cells:
            raise InputError(f"scenario {cfg.scenario.name}: node {kill.node} holds every cell {list(kill.cells)}; "
                             f"no cell would survive to heal them")
    unrestored = sorted({a.node for a in kills} - restored)
    if unrestored:
        raise InputError(f"scenario {cfg.scenario.name}: node(s) {unrestored} are never restored "
                         f"(add a restore_node_at_end action), so no heal would be proven")


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    return verify_phases(cfg, run_dir)
