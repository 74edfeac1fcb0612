"""Comparison scenarios: the target must reproduce the baseline, and its fault plan must show.

Every phase is checked the same way — dumps tensor by tensor, metrics key by key, the exact set
of dump leaves, which tensors exist (names, shapes, dtypes on both sides, every rollout), and the
exact list of reconfigure events on each side. What the event log must hold is derived from the phase's fault plan alone (never from the outputs): :func:`expect` plays
the plan against the group's rules — a crash shrinks the quorum at its rollout, a cell stopped
and started after rollout k is healed at k+1 from the lowest-index cell still alive — so a plan
that hits cell 0, a middle cell or the last cell each names its own shrinks, sources and heals.
The same play says which cells commit each rollout: in a new quorum (the phase's first rollout, and each
one with a reconfigure), every one of them but the first dumps to its own root, compared with the
baseline too (``cell_dumps``). A resumed phase's sides are each also checked on their own against the
plan (``resume``): comparing them cannot see what both lose alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ftexp.config import ExperimentConfig, PhaseConfig
from ftexp.engines.registry import get_engine
from ftexp.faults.plan import FaultPlan, TestActionKind
from ftexp.placement import placement_for
from ftexp.rundir import BASELINE, TARGET, SideDir, dump_leaf_name, side_dir
from ftexp.scenarios.cell_dumps import check_cell_dumps
from ftexp.scenarios.checks import (check_event_rules, check_faults, check_leaves, check_placement,
                                    check_target_commits, recovery_timings)
from ftexp.scenarios.resume import resume_checks
from ftexp.verify.dumps import compare_dumps
from ftexp.verify.engines import check_engine_updates, check_injections, compare_inference_engine_checksums
from ftexp.verify.inventory import compare_inventories
from ftexp.verify.metrics import compare_metrics
from ftexp.verify.reconfigure import ReconfigureInfo, check_reconfigure_events
from ftexp.verify.report import CheckResult

REQUIRED_METRICS = ("train/loss", "train/grad_norm")


@dataclass
class PhaseExpectation:
    rollouts: list[int]                                  # rollouts trained in this phase
    target_reconfigures: list[ReconfigureInfo] = field(default_factory=list)
    baseline_reconfigures: list[ReconfigureInfo] = field(default_factory=list)
    faults_injected: int = 0                             # crash test actions that must have fired
    committers: dict[int, list[int]] = field(default_factory=dict)  # rollout -> the cells that commit it
    new_quorums: list[int] = field(default_factory=list)  # rollouts committed in a quorum the one before was not


def phase_rollouts(cfg: ExperimentConfig, phase: PhaseConfig) -> list[int]:
    """The rollout ids a phase trains, derived from the phase plan alone (not from the outputs)."""
    phases = cfg.scenario.phases
    start = 0
    for earlier in phases[: phases.index(phase)]:
        if earlier.name == phase.load_from:
            start = phase_rollouts(cfg, earlier)[-1] + 1
    end = cfg.scenario.num_rollout
    if phase.exit_after_rollouts is not None:
        end = min(end, start + phase.exit_after_rollouts)
    return list(range(start, end))


def planned_reconfigures(plan: FaultPlan, rollouts: list[int], num_cells: int,
                         committers: dict[int, list[int]] | None = None) -> list[ReconfigureInfo]:
    """The reconfigure events the plan must cause over ``rollouts``, every phase starting with all cells alive.

    Before each rollout the group refreshes: cells started since the last rollout are healed from
    the lowest-index alive cell, cells stopped without a restart shrink out. A crash during a
    rollout discards that attempt, and the retry's refresh shrinks the crashed cell out.
    ``committers``, if given, receives the cells that commit each rollout.
    """
    alive, pending, quorum = set(range(num_cells)), set(), set(range(num_cells))
    events = []
    for rollout_id in rollouts:
        if pending:
            events.append(ReconfigureInfo(rollout_id, min(alive), sorted(pending), sorted(alive | pending)))
            alive |= pending
            pending = set()
        elif alive != quorum:
            events.append(ReconfigureInfo(rollout_id, None, [], sorted(alive)))
        quorum = set(alive)
        crashed = {a.cell for a in plan.of_kind(TestActionKind.crash_before_allreduce) if a.at_rollout == rollout_id}
        crashed |= {c for a in plan.of_kind(TestActionKind.kill_node_before_allreduce)  # a lost node takes all its cells
                    if a.at_rollout == rollout_id and a.cell in alive for c in a.cells}
        if crashed & alive and len(alive) > 1:
            alive -= crashed
            events.append(ReconfigureInfo(rollout_id, None, [], sorted(alive)))
            quorum = set(alive)
        if committers is not None:
            committers[rollout_id] = sorted(alive)
        for action in plan.group_actions_after(rollout_id):
            if action.action == TestActionKind.stop_cell_at_end:
                alive.discard(action.cell)
                pending.discard(action.cell)
            elif action.action == TestActionKind.restore_node_at_end:
                pending |= set(action.cells) - alive
            elif action.cell not in alive:
                pending.add(action.cell)
    return events


def expect(cfg: ExperimentConfig, phase: PhaseConfig) -> PhaseExpectation:
    """What one phase must show: its rollouts, its plan's faults, and every reconfigure in its event
    log — including those of the phase it resumes from, whose events it restores."""
    rollouts = phase_rollouts(cfg, phase)
    n = cfg.mode.num_cells
    plan = FaultPlan(phase.target_actions, n, placement_for(cfg))
    crashes = [a for kind in (TestActionKind.crash_before_allreduce, TestActionKind.kill_node_before_allreduce)
               for a in plan.of_kind(kind) if a.at_rollout in rollouts]
    committers: dict[int, list[int]] = {}
    reconfigures = planned_reconfigures(plan, rollouts, n, committers)
    # A phase starts new processes; every reconfigure forms a new quorum.
    new_quorums = sorted({rollouts[0], *(r.rollout_id for r in reconfigures)}) if rollouts else []
    if phase.load_from is not None:
        earlier = next(p for p in cfg.scenario.phases if p.name == phase.load_from)
        reconfigures = expect(cfg, earlier).target_reconfigures + reconfigures
    return PhaseExpectation(rollouts=rollouts, target_reconfigures=reconfigures, faults_injected=len(crashes),
                            committers=committers, new_quorums=new_quorums)


def check_phase(cfg: ExperimentConfig, run_dir: Path, phase: PhaseConfig, expected: PhaseExpectation) -> list[CheckResult]:
    label = f"{phase.name}/" if phase.name else ""
    base, targ = side_dir(run_dir, BASELINE, phase.name), side_dir(run_dir, TARGET, phase.name)
    th = cfg.threshold
    # A dump rule for a feature the model lacks may match nothing.
    features = get_engine(cfg.trainer.engine).model_features(cfg.mode)
    checks = [
        check_leaves(base.dumps, expected.rollouts, f"{label}dump_leaves"),
        # Which tensors exist (both sides, every rollout), apart from their values.
        compare_inventories(base.dumps, targ.dumps, [dump_leaf_name(r) for r in expected.rollouts],
                            exclude_pattern=th.exclude_pattern).to_check(f"{label}tensor_inventory"),
        compare_dumps(base.dumps, targ.dumps, [tuple(r) for r in th.dumps], model_features=features,
                      exclude_pattern=th.exclude_pattern, allow_skipped_pattern=th.allow_skipped_pattern,
                      allow_failed_pattern=th.allow_failed_pattern).to_check(f"{label}dumps"),
    ]
    if th.fp32_dumps:  # every engine here trains in fp32 on CPU
        checks.append(compare_dumps(base.dumps, targ.dumps, [tuple(r) for r in th.fp32_dumps], model_features=features,
                                    exclude_pattern=th.exclude_pattern, allow_skipped_pattern=th.allow_skipped_pattern,
                                    allow_failed_pattern=th.allow_failed_pattern).to_check(f"{label}dumps_fp32"))
    # Every other alive cell's own dumps (a healed cell's, a survivor's), with the same rules. They are
    # part of the audit: without it only the first alive cell dumps, and the report says so.
    if cfg.trainer.audit:
        checks += check_cell_dumps(base.dumps, targ, expected.committers, expected.new_quorums, cfg.mode.num_cells,
                                   th, features=features, label=label)
    else:
        checks.append(CheckResult(f"{label}cell_dumps", True, "NOT RUN: trainer.audit=false — only the first alive "
                                  "cell dumped, so the other cells' own dumps were not compared", {"not_run": True}))
    for m in th.metrics:
        # Every metric rule must cover at least one of the keys that are required to exist.
        required = [k for k in REQUIRED_METRICS if k.startswith(tuple(m.prefixes)) and k not in m.exclude]
        checks.append(compare_metrics(base.events, targ.events, rtol=m.rtol, atol=m.atol,
                                      key_prefixes=list(m.prefixes), exclude_keys=list(m.exclude),
                                      required_keys=required)
                      .to_check(f"{label}metrics[{','.join(m.prefixes)}]"))
    checks.append(check_reconfigure_events(base.events, expected.baseline_reconfigures, f"{label}baseline_reconfigures"))
    checks.append(check_reconfigure_events(targ.events, expected.target_reconfigures, f"{label}target_reconfigures"))
    checks.append(check_target_commits(targ.events, expected.rollouts, f"{label}target_commits"))
    checks += resume_checks(cfg, run_dir, phase, expected.rollouts, label)  # each side on its own, if resumed
    checks.append(check_faults(targ.events, expected.faults_injected, f"{label}faults_injected"))
    if (placement := placement_for(cfg)) is not None:  # multi-node: each cell where the placement put it
        checks.append(check_placement(targ.events, placement, f"{label}placement"))
    checks.append(check_event_rules(targ.events, f"{label}target_event_analyzer", audit=cfg.trainer.audit,
                                    expect_witness=cfg.trainer.witness_on))
    if cfg.mode.rollout_num_engines:
        checks += _engine_checks(cfg, base, targ, phase, expected.rollouts, label)
    if expected.target_reconfigures:
        checks.append(recovery_timings(targ.events, f"{label}recovery"))
    return checks


def _engine_checks(cfg: ExperimentConfig, base: SideDir, targ: SideDir, phase: PhaseConfig, rollouts: list[int],
                   label: str) -> list[CheckResult]:
    """Live rollout engines: each side fed its engines after every rollout; deterministic runs fed
    both sides' engines the same bits; the planned injections passed the match guard."""
    engines = cfg.mode.rollout_num_engines
    checks = [check_engine_updates(side.events, rollouts, engines, f"{label}{name}_engine_updates")
              for name, side in ((BASELINE, base), (TARGET, targ))]
    if cfg.scenario.deterministic:
        checks.append(compare_inference_engine_checksums(base.events, targ.events, f"{label}engine_checksums"))
    ratio = cfg.mode.rollout_inject_min_match_ratio
    heal = FaultPlan(phase.target_actions, cfg.mode.num_cells, placement_for(cfg)).first_heal_rollout()
    if ratio is not None and heal is not None:
        checks.append(check_injections(targ.events, [r for r in rollouts if r >= heal], ratio,
                                       f"{label}rollout_injection"))
    return checks


def verify_phases(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    """Every phase's checks, each phase against what its own plan expects."""
    checks: list[CheckResult] = []
    for phase in cfg.scenario.phases:
        checks += check_phase(cfg, run_dir, phase, expect(cfg, phase))
    return checks
