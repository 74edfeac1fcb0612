"""The checks run on every phase of every comparison scenario.

Each returns a ``CheckResult``; all of them fail closed: a missing directory, a missing leaf, a
missing event or an unmatched tensor is a failure, never a silent pass.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.audit.events import FaultInjectedEvent, TrainGroupStepEndEvent, read_events
from ftexp.config import ExperimentConfig, PhaseConfig
from ftexp.scenarios.expectations import PhaseExpectation
from ftexp.verify.dumps import compare_dumps, leaf_set
from ftexp.verify.metrics import compare_metrics
from ftexp.verify.reconfigure import check_reconfigure_events
from ftexp.verify.report import CheckResult


def _side_dir(run_dir: Path, side: str, phase: str) -> Path:
    return run_dir / side / phase if phase else run_dir / side


def check_phase(cfg: ExperimentConfig, run_dir: Path, phase: PhaseConfig, expect: PhaseExpectation) -> list[CheckResult]:
    label = f"{phase.name}/" if phase.name else ""
    base, targ = _side_dir(run_dir, "baseline", phase.name), _side_dir(run_dir, "target", phase.name)
    th = cfg.threshold
    checks = [
        check_leaves(base / "dumps", expect.rollouts, f"{label}dump_leaves"),
        compare_dumps(base / "dumps", targ / "dumps", [tuple(r) for r in th.dumps],
                      exclude_pattern=th.exclude_pattern, allow_skipped_pattern=th.allow_skipped_pattern,
                      allow_failed_pattern=th.allow_failed_pattern).to_check(f"{label}dumps"),
    ]
    for i, m in enumerate(th.metrics):
        checks.append(compare_metrics(base / "events", targ / "events", rtol=m.rtol, atol=m.atol,
                                      key_prefixes=list(m.prefixes), exclude_keys=list(m.exclude))
                      .to_check(f"{label}metrics[{','.join(m.prefixes)}]"))
    checks.append(check_reconfigure_events(base / "events", expect.baseline_reconfigures, f"{label}baseline_reconfigures"))
    checks.append(check_reconfigure_events(targ / "events", expect.target_reconfigures, f"{label}target_reconfigures"))
    checks.append(check_target_commits(targ / "events", expect.rollouts, f"{label}target_commits"))
    checks.append(check_faults(targ / "events", expect, f"{label}faults_injected"))
    return checks


def check_leaves(dumps_root: Path, rollouts: list[int], name: str) -> CheckResult:
    """The baseline's leaves must be exactly one per trained rollout: none may escape comparison."""
    expected = [f"fwd_bwd/rollout_{r}" for r in rollouts]
    actual = leaf_set(dumps_root) if dumps_root.is_dir() else []
    ok = sorted(actual) == sorted(expected)
    return CheckResult(name, ok, f"leaves {actual}" + ("" if ok else f", expected {expected}"),
                       {"expected": expected, "actual": actual})


def check_target_commits(events_dir: Path, rollouts: list[int], name: str) -> CheckResult:
    """Positive proof the target ran as cells: one group step-end event per rollout, in order."""
    committed = [e.rollout_id for e in read_events(events_dir) if isinstance(e, TrainGroupStepEndEvent)
                 and e.rollout_id in rollouts]
    ok = committed == rollouts
    return CheckResult(name, ok, f"group commits for rollouts {committed}" + ("" if ok else f", expected {rollouts}"),
                       {"expected": rollouts, "actual": committed})


def check_faults(events_dir: Path, expect: PhaseExpectation, name: str) -> CheckResult:
    """Every planned crash must have fired (a fault_injected event), and no unplanned one."""
    fired = [e for e in read_events(events_dir) if isinstance(e, FaultInjectedEvent)]
    ok = len(fired) == expect.faults_injected
    return CheckResult(name, ok, f"{len(fired)} injected fault(s), expected {expect.faults_injected}",
                       {"fired": [e.model_dump(mode="json") for e in fired]})
