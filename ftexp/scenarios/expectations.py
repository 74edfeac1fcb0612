"""What each scenario expects of each phase (spec §15.3–15.5).

Cells are numbered 0..N-1; the scenarios crash and heal the *last* cell, so cell 0 stays the
source of every heal and the writer of metrics and dumps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ftexp.config import ExperimentConfig, PhaseConfig, TestActionKind
from ftexp.verify.reconfigure import ReconfigureInfo


@dataclass
class PhaseExpectation:
    rollouts: list[int]                                  # rollouts trained in this phase
    target_reconfigures: list[ReconfigureInfo] = field(default_factory=list)
    baseline_reconfigures: list[ReconfigureInfo] = field(default_factory=list)
    faults_injected: int = 0                             # crash test actions that must have fired


def _phase_rollouts(cfg: ExperimentConfig, phase: PhaseConfig) -> list[int]:
    """The rollout ids a phase trains, derived from the phase plan alone (not from the outputs)."""
    phases = cfg.scenario.phases
    start = 0
    for earlier in phases[: phases.index(phase)]:
        if earlier.name == phase.load_from:
            start = _phase_rollouts(cfg, earlier)[-1] + 1
    end = cfg.scenario.num_rollout
    if phase.exit_after_rollouts is not None:
        end = min(end, start + phase.exit_after_rollouts)
    return list(range(start, end))


def _heal(rollout_id: int, n: int) -> ReconfigureInfo:
    return ReconfigureInfo(rollout_id=rollout_id, src_cell_index=0, healed_cell_indices=[n - 1],
                           alive_cell_indices_after=list(range(n)))


def no_failure(cfg: ExperimentConfig, phase: PhaseConfig) -> PhaseExpectation:
    return PhaseExpectation(rollouts=_phase_rollouts(cfg, phase))


def with_failure(cfg: ExperimentConfig, phase: PhaseConfig) -> PhaseExpectation:
    """phase_b: a shrink at the crash rollout, then a heal at the next one (spec §15.4)."""
    expect = PhaseExpectation(rollouts=_phase_rollouts(cfg, phase))
    crashes = [a for a in phase.target_actions if a.action == TestActionKind.crash_before_allreduce]
    n = cfg.mode.num_cells
    for crash in crashes:
        expect.target_reconfigures += [
            ReconfigureInfo(crash.at_rollout, None, [], list(range(n - 1))),
            _heal(crash.at_rollout + 1, n),
        ]
    expect.faults_injected = len(crashes)
    return expect


def deterministic(cfg: ExperimentConfig, phase: PhaseConfig) -> PhaseExpectation:
    """One heal at P+2 per target phase; phase_b also sees phase_a's heal from the restored events."""
    expect = PhaseExpectation(rollouts=_phase_rollouts(cfg, phase))
    phases = cfg.scenario.phases
    for p in phases[: phases.index(phase) + 1]:
        if p is phase or p.name == phase.load_from:
            starts = {a.at_rollout for a in p.target_actions if a.action == TestActionKind.start_cell_at_end}
            expect.target_reconfigures += [_heal(r + 1, cfg.mode.num_cells) for r in sorted(starts)]
    return expect


EXPECTATIONS = {
    "no_failure": no_failure,
    "with_failure": with_failure,
    "deterministic": deterministic,
}
