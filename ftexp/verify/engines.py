"""Rollout-engine weight checks: what the engines held after every weight update, on each side.

After every commit the trainer pushes its weights to the rollout engines and logs one
``InferenceEngineWeightChecksumEvent`` (one dict of HF tensor name -> hash per engine; rollout id
None for the initial sync). Two checks read them, both fail closed:

* ``check_engine_updates`` (one side): an update for every trained rollout (and the initial
  sync), each with the expected number of engines, all engines holding engine 0's weights — so
  an update skipped after a heal, or an engine fed from another cell, shows.
* ``compare_inference_engine_checksums`` (baseline vs target): per rollout id, engine 0 of each
  side holds bitwise-identical weights. Only deterministic runs can demand that; the engine
  counts of the sides may differ.
* ``check_injections`` (target): the rollouts planned to train on the baseline's recorded data did,
  each after its live generation matched that data (the match ratio is reported).
"""

from __future__ import annotations

from pathlib import Path

from ftexp.audit.analyzer import engine_checksum_issues
from ftexp.audit.events import InferenceEngineWeightChecksumEvent, RolloutInjectedEvent, read_events
from ftexp.verify.report import CheckResult

SHOWN = 5


def engine_updates(events_dir: Path) -> list[InferenceEngineWeightChecksumEvent]:
    return [e for e in read_events(events_dir) if isinstance(e, InferenceEngineWeightChecksumEvent)]


def check_engine_updates(events_dir: Path, rollouts: list[int], num_engines: int, name: str,
                         initial_sync: bool = True) -> CheckResult:
    """Every trained rollout (and, on a cold start, the initial sync) ended in a consistent engine update."""
    updates = engine_updates(events_dir)
    issues = [str(i) for e in updates for i in engine_checksum_issues(e)]
    issues += [f"rollout {e.rollout_id}: {len(e.engine_checksums)} engines answered, expected {num_engines}"
               for e in updates if len(e.engine_checksums) != num_engines]
    issues += [f"rollout {e.rollout_id}: engine checksums are empty" for e in updates
               if any(not c for c in e.engine_checksums)]
    seen = [e.rollout_id for e in updates]
    expected = ([None] if initial_sync else []) + list(rollouts)
    missing = [r for r in expected if r not in seen]
    if missing:
        issues.append(f"no engine update after rollouts {missing} (None: the initial sync)")
    summary = (f"{len(updates)} engine updates x {num_engines} engines, rollouts {seen}; {len(issues)} issue(s)"
               + (f": {issues[0]}" if issues else ""))
    return CheckResult(name, not issues, summary, {"updates": seen, "issues": issues[:50]})


def compare_inference_engine_checksums(baseline_events: Path, target_events: Path, name: str) -> CheckResult:
    """Bitwise-equal engine weights on both sides for every rollout id both updated after."""
    sides = {"baseline": engine_updates(baseline_events), "target": engine_updates(target_events)}
    issues: list[str] = []
    per_side: dict[str, dict[int, dict[str, str]]] = {}
    for side, updates in sides.items():
        if not updates:
            issues.append(f"{side}: no engine checksum events")
        issues += [f"{side}: {i}" for e in updates for i in engine_checksum_issues(e)]
        by_rollout: dict[int, dict[str, str]] = {}
        for e in updates:
            if e.rollout_id is None:  # initial syncs: one per phase start, compared through the rollouts after
                continue
            if e.rollout_id in by_rollout:
                issues.append(f"{side}: two engine updates for rollout {e.rollout_id}")
            if not e.engine_checksums:
                issues.append(f"{side}: rollout {e.rollout_id} has no engines")
                continue
            by_rollout[e.rollout_id] = e.engine_checksums[0]
        per_side[side] = by_rollout
    base, targ = per_side["baseline"], per_side["target"]
    if set(base) != set(targ):
        issues.append(f"rollout ids differ: baseline {sorted(base)}, target {sorted(targ)}")
    compared = sorted(set(base) & set(targ))
    for rollout_id in compared:
        differing = sorted(k for k in base[rollout_id].keys() | targ[rollout_id].keys()
                           if base[rollout_id].get(k, "<missing>") != targ[rollout_id].get(k, "<missing>"))
        if differing:
            issues.append(f"rollout {rollout_id}: {len(differing)} engine tensors differ, e.g. {differing[:SHOWN]}")
    summary = (f"{len(compared)} rollouts compared, engine 0 of each side; {len(issues)} issue(s)"
               + (f": {issues[0]}" if issues else ""))
    return CheckResult(name, not issues, summary, {"rollouts": compared, "issues": issues[:50]})


def check_injections(events_dir: Path, rollouts: list[int], min_match_ratio: float, name: str) -> CheckResult:
    """Each of ``rollouts`` was generated live and replaced by the recorded one only after the match guard."""
    injected = {e.rollout_id: e for e in read_events(events_dir) if isinstance(e, RolloutInjectedEvent)}
    issues = [f"rollout {r}: no injection" for r in rollouts if r not in injected]
    issues += [f"rollout {r}: injected at match ratio {e.match_ratio:.3f}, not above {min_match_ratio}"
               for r, e in sorted(injected.items()) if not e.match_ratio > min_match_ratio]
    issues += [f"rollout {r}: injected, but no injection was planned there" for r in sorted(injected) if r not in rollouts]
    ratios = {r: round(e.match_ratio, 4) for r, e in sorted(injected.items())}
    summary = (f"rollouts {sorted(injected)} trained on the baseline's recorded rollouts; mean token match ratios "
               f"{ratios} (must be > {min_match_ratio})" + (f"; {issues[0]}" if issues else ""))
    return CheckResult(name, not issues, summary, {"match_ratios": ratios, "issues": issues})
