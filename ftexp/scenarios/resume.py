"""Absolute resume checks: what a resumed phase must have restored, derived from the plan alone.

Comparing a resumed target with a resumed baseline cannot see what both lose the same way: an
event log that is not restored (the witness counter restarts at 0, the earlier phase's commits
vanish from the audit trail), or a job that starts from the wrong rollout. So each side of a phase
with ``load_from`` is checked on its own against the plan:

- the checkpoint it resumed from is the last one the earlier phase saves (its ``save_interval``),
  and every loaded rank state says it last committed that rollout (the ``train_resume`` event);
- the event log holds the restored history: a commit (the target's group step end, the baseline's
  metrics) of every rollout up to the checkpoint, with its witness snapshots and (target) weight
  checksums, and every file of the checkpoint's event snapshot as a prefix of the phase's log;
- the witness counter continues from the checkpoint's: the resume event's counter is the one the
  snapshot holds, at least one id per sample of every rollout up to the checkpoint, and the first
  allocation after the resume starts from it;
- the first rollout trained after the resume is the checkpoint's + 1, and nothing up to the
  checkpoint is trained again.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.audit.events import (MetricEvent, TrainEngineLocalWeightChecksumEvent, TrainGroupStepEndEvent,
                                TrainResumeEvent, WitnessAllocateIdEvent, WitnessSnapshotParamEvent, read_events)
from ftexp.audit.witness import persisted_counter
from ftexp.config import ExperimentConfig, PhaseConfig
from ftexp.engines.registry import get_engine
from ftexp.rundir import BASELINE, TARGET, events_snapshot, side_dir
from ftexp.verify.report import CheckResult

# How many missing rollouts or files an issue names before it only counts the rest.
SHOWN = 8


def phase_start(cfg: ExperimentConfig, phase: PhaseConfig) -> int:
    """The first rollout a phase trains: 0, or the checkpoint it resumes from + 1."""
    if phase.load_from is None:
        return 0
    checkpoint = resume_checkpoint(cfg, phase)
    return 0 if checkpoint is None else checkpoint + 1


def saved_rollouts(cfg: ExperimentConfig, phase: PhaseConfig) -> list[int]:
    """The rollouts a phase checkpoints (``JobSpec.should_save`` over the rollouts it trains)."""
    if phase.save_interval is None:
        return []
    start, end = phase_start(cfg, phase), cfg.scenario.num_rollout
    if phase.exit_after_rollouts is not None:
        end = min(end, start + phase.exit_after_rollouts)
    last = cfg.scenario.num_rollout - 1
    return [r for r in range(start, end) if r == last or (r + 1) % phase.save_interval == 0]


def resume_checkpoint(cfg: ExperimentConfig, phase: PhaseConfig) -> int | None:
    """The rollout id of the checkpoint ``phase`` resumes from: the earlier phase's last; None if it saves none."""
    earlier = next(p for p in cfg.scenario.phases if p.name == phase.load_from)
    saved = saved_rollouts(cfg, earlier)
    return saved[-1] if saved else None


def _show(items: list) -> str:
    return f"{items[:SHOWN]}" + (f" (+{len(items) - SHOWN} more)" if len(items) > SHOWN else "")


def _snapshot_restored(snapshot: Path, events_dir: Path) -> list[str]:
    """Files of the checkpoint's event snapshot that the phase's log does not start with."""
    issues = []
    for path in sorted(snapshot.glob("**/*.jsonl")):
        restored = events_dir / path.relative_to(snapshot)
        if not restored.is_file():
            issues.append(f"{path.relative_to(snapshot)} missing")
        elif not restored.read_bytes().startswith(path.read_bytes()):
            issues.append(f"{path.relative_to(snapshot)} does not start with the snapshot's events")
    return issues


def check_resume(cfg: ExperimentConfig, run_dir: Path, phase: PhaseConfig, side: str, rollouts: list[int],
                 name: str) -> CheckResult:
    """One side of a resumed phase against the plan (see the module doc). Fails closed."""
    checkpoint = resume_checkpoint(cfg, phase)
    if checkpoint is None:
        return CheckResult(name, False, f"phase {phase.load_from!r} saves no checkpoint to resume from")
    events_dir = side_dir(run_dir, side, phase.name).events
    events = read_events(events_dir)
    snapshot = events_snapshot(side_dir(run_dir, side, phase.load_from).ckpt, checkpoint)
    snapshot_events = read_events(snapshot)
    snapshot_counter = persisted_counter(snapshot_events)
    witness_on = cfg.trainer.witness_on
    samples = cfg.trainer.rollout.samples
    ranks = cfg.mode.num_cells * get_engine(cfg.trainer.engine).ranks_per_replica(cfg.mode)
    issues: list[str] = []

    # The phase's own resume event comes after those it restored (an earlier phase may have resumed too).
    resumes = sorted((e for e in events if isinstance(e, TrainResumeEvent)), key=lambda e: e.timestamp)
    restored_resumes = sum(isinstance(e, TrainResumeEvent) for e in snapshot_events)
    details = {"checkpoint_rollout_id": checkpoint, "snapshot_witness_counter": snapshot_counter,
               "resume_events": [e.model_dump(mode="json", exclude={"source"}) for e in resumes]}
    if len(resumes) != restored_resumes + 1:
        issues.append(f"{len(resumes)} train_resume events, expected {restored_resumes} restored + 1 of this phase: "
                      f"the job did not say what it restored")
        return CheckResult(name, False, issues[0], details)
    resume = resumes[-1]
    if resume.checkpoint_rollout_id != checkpoint:
        issues.append(f"resumed from checkpoint {resume.checkpoint_rollout_id}, the plan's is {checkpoint}")
    if resume.first_rollout_id != checkpoint + 1 or rollouts[0] != checkpoint + 1:
        issues.append(f"first rollout {resume.first_rollout_id} (the plan's phase starts at {rollouts[0]}), "
                      f"expected the checkpoint's + 1 = {checkpoint + 1}")
    if resume.loaded_rollout_ids != [checkpoint] * ranks:
        issues.append(f"loaded rank states last committed {_show(resume.loaded_rollout_ids)}, expected {ranks} x {checkpoint}")

    # The restored history: every rollout up to the checkpoint committed, snapshotted and checksummed.
    history = range(checkpoint + 1)
    commit_type = TrainGroupStepEndEvent if side == TARGET else MetricEvent
    kinds = {"commit": commit_type}
    if witness_on:
        kinds["witness snapshot"] = WitnessSnapshotParamEvent
    if side == TARGET and getattr(cfg.trainer, "audit", True):  # trainer.audit=false logs no checksums
        kinds["weight checksum"] = TrainEngineLocalWeightChecksumEvent
    for what, kind in kinds.items():
        logged = {e.rollout_id for e in events if isinstance(e, kind)}
        missing = [r for r in history if r not in logged]
        if missing:
            issues.append(f"restored log lacks the {what} events of rollouts {_show(missing)}")
    issues += [f"event snapshot {i}" for i in _snapshot_restored(snapshot, events_dir)]

    # The witness counter continues from the checkpoint's.
    if resume.witness_counter != snapshot_counter:
        issues.append(f"witness counter resumed at {resume.witness_counter}, the checkpoint's snapshot holds {snapshot_counter}")
    if witness_on:
        floor = samples * (checkpoint + 1)
        if resume.witness_counter < floor:
            issues.append(f"witness counter resumed at {resume.witness_counter}, below the {floor} ids that rollouts "
                          f"0..{checkpoint} allocated at least")
        first = [e for e in events if isinstance(e, WitnessAllocateIdEvent) and e.rollout_id == checkpoint + 1
                 and e.attempt == 0]
        if not first or first[0].counter_after != resume.witness_counter + samples:
            got = first[0].counter_after if first else None
            issues.append(f"rollout {checkpoint + 1}'s first allocation ends at counter {got}, expected "
                          f"{resume.witness_counter} + {samples}")

    # Training after the resume starts at the checkpoint's rollout + 1 and never goes back.
    trained = [e.rollout_id for e in sorted(events, key=lambda e: e.timestamp)
               if isinstance(e, commit_type) and e.timestamp > resume.timestamp]
    details["trained_after_resume"] = trained
    if not trained or trained[0] != checkpoint + 1 or min(trained) <= checkpoint:
        issues.append(f"rollouts committed after the resume {_show(trained)}: expected to start at {checkpoint + 1}")

    details["issues"] = issues
    summary = (f"resumed from checkpoint {checkpoint} ({ranks} rank states), witness counter {resume.witness_counter}, "
               f"history 0..{checkpoint} restored, first trained rollout {trained[0] if trained else None}")
    return CheckResult(name, not issues, f"{len(issues)} issue(s); first: {issues[0]}" if issues else summary, details)


def resume_checks(cfg: ExperimentConfig, run_dir: Path, phase: PhaseConfig, rollouts: list[int],
                  label: str) -> list[CheckResult]:
    """Both sides of a resumed phase; nothing for a phase that starts cold."""
    if phase.load_from is None:
        return []
    return [check_resume(cfg, run_dir, phase, side, rollouts, f"{label}{side}_resume") for side in (BASELINE, TARGET)]
