"""The checks of the audit trail that every scenario kind runs on a side's outputs.

Each returns a ``CheckResult``; all of them fail closed: a missing directory, a missing leaf, a
missing event or an unmatched tensor is a failure, never a silent pass.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.audit.analyzer import analyze
from ftexp.audit.events import (CellLifecycleEvent, CellPlacementEvent, CellReconfigureEvent, EnginePlacementEvent, FaultInjectedEvent, NodeStateEvent, TrainEngineLocalWeightChecksumEvent, TrainGroupStepEndEvent,
                                WitnessAllocateIdEvent, WitnessSnapshotParamEvent, read_events)
from ftexp.verify.dumps import leaf_set
from ftexp.verify.report import CheckResult

def recovery_timings(events_dir: Path, name: str) -> CheckResult:
    """Per fault and heal: detection, reconfiguration, state transfer, first commit (seconds), bytes.

    Detection = fault event → the shrink that excluded the cell; first commit = reconfigure event →
    the next group commit. A heal's row also says whether its cells took warm spares (``spare``), and
    times the whole way back: the healed cell's start request → that first commit (``start_to_commit_s``:
    waiting for the refresh, allocate, configure, transfer, load, one step) and the last fault before
    it → that commit (``fault_to_commit_s``). Fails only if a reconfigure has no following commit.
    """
    events = read_events(events_dir)
    faults = [e for e in events if isinstance(e, FaultInjectedEvent)]
    nodes = sorted((e for e in events if isinstance(e, NodeStateEvent) and e.state == "rejoined"),
                   key=lambda e: e.timestamp)
    commits = sorted((e for e in events if isinstance(e, TrainGroupStepEndEvent)), key=lambda e: e.timestamp)
    starts = sorted((e for e in events if isinstance(e, CellLifecycleEvent) and e.transition == "start_requested"),
                    key=lambda e: e.timestamp)
    rows = []
    for e in sorted((e for e in events if isinstance(e, CellReconfigureEvent)), key=lambda e: e.timestamp):
        commit = next((c for c in commits if c.timestamp >= e.timestamp), None)
        row = {"rollout_id": e.rollout_id, "kind": "heal" if e.healed_cell_indices else "shrink",
               "alive_after": e.alive_cell_indices_after, "bytes": e.bytes_transferred,
               **{k: round(v, 3) for k, v in e.timings.items()},
               "first_commit_s": round((commit.timestamp - e.timestamp).total_seconds(), 3) if commit else None}
        if not e.healed_cell_indices:
            fault = next((f for f in reversed(faults) if f.timestamp <= e.timestamp), None)
            row["detection_s"] = round((e.timestamp - fault.timestamp).total_seconds(), 3) if fault else None
            if fault is not None and fault.node_index is not None:
                row["node_lost"] = fault.node_index
        elif e.timings.get("transfer_s"):
            row["heal_bytes_per_s"] = round(e.bytes_transferred / e.timings["transfer_s"])
            row["connections"] = e.transfer_connections
        if e.healed_cell_indices:
            row["spare"] = set(e.spare_cell_indices) == set(e.healed_cell_indices)
            start = next((s for s in reversed(starts) if s.timestamp <= e.timestamp and s.cell_index in e.healed_cell_indices), None)
            fault = next((f for f in reversed(faults) if f.timestamp <= e.timestamp), None)
            for key, since in (("start_to_commit_s", start), ("fault_to_commit_s", fault)):
                if since is not None and commit is not None:
                    row[key] = round((commit.timestamp - since.timestamp).total_seconds(), 3)
        if e.healed_cell_indices:  # a node that came back before this heal: how long it was away, how long to rejoin
            node = next((n for n in reversed(nodes) if n.timestamp <= e.timestamp), None)
            if node is not None and not any(r.get("node_back") == node.node_index for r in rows):
                row.update({"node_back": node.node_index, **{f"node_{k}": v for k, v in node.timings.items()},
                            "node_back_to_heal_s": round((e.timestamp - node.timestamp).total_seconds(), 3)})
        rows.append(row)
    ok = all(r["first_commit_s"] is not None for r in rows)
    summary = "; ".join(
        f"{r['kind']}@{r['rollout_id']}: " + ", ".join(f"{k}={v}" for k, v in r.items()
                                                        if k.endswith("_s") or k in ("bytes", "heal_bytes_per_s", "spare", "node_lost", "node_back"))
        for r in rows)
    return CheckResult(name, ok, summary or "no reconfigure events", {"recoveries": rows})


def check_event_rules(events_dir: Path, name: str, *, audit: bool = True, expect_witness: bool = True) -> CheckResult:
    """The analyzer's rules on the finished log: all cells bitwise equal after every heal, every
    committed cell's witness rows exactly the samples of the committed attempts, ...

    Fails closed when a rule had nothing to check: no checksum events, or (with the witness on)
    no witness snapshots. With the audit off (``trainer.audit=false``) the rules have nothing to
    check by design: the check says so in its summary instead of passing silently.
    """
    if not audit:
        return CheckResult(name, True, "NOT RUN: trainer.audit=false — no weight checksums and no witness ids "
                           "were recorded, so the cross-replica checksum and witness rules did not run",
                           {"not_run": ["cross_replica_weight_checksum", "witness"]})
    events = read_events(events_dir)
    checksums = sum(isinstance(e, TrainEngineLocalWeightChecksumEvent) for e in events)
    snapshots = sum(isinstance(e, WitnessSnapshotParamEvent) for e in events)
    attempts: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, WitnessAllocateIdEvent):
            attempts.setdefault(e.rollout_id, []).append(e.attempt)
    issues = analyze(events)
    details = {"issues": [str(i) for i in issues], "checksum_events": checksums, "witness_snapshot_events": snapshots,
               "witness_allocation_attempts": attempts}
    if not checksums:
        return CheckResult(name, False, "no weight checksum events: the cross-replica rule had nothing to check", details)
    if expect_witness and not snapshots:
        return CheckResult(name, False, "no witness snapshot events: the witness rule had nothing to check", details)
    return CheckResult(name, not issues, f"{checksums} checksum events, {snapshots} witness snapshots, "
                       f"{len(issues)} issue(s)" + (f": {issues[0]}" if issues else ""), details)


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


def check_placement(events_dir: Path, placement, name: str) -> CheckResult:
    """Multi-node: every cell logged where its ranks run (``cell_placement``), every allocation (heals too) on
    the nodes the placement planned; every rollout engine (``engine_placement``) on its planned rollout node."""
    events = read_events(events_dir)
    placed = [e for e in events if isinstance(e, CellPlacementEvent)]
    engines = [e for e in events if isinstance(e, EnginePlacementEvent)]
    planned_engines = dict(enumerate(placement.engine_nodes))
    wrong = [f"cell {e.cell_index} (incarnation {e.incarnation}) on {e.rank_nodes}, planned "
             f"{list(placement.rank_nodes[e.cell_index])}" for e in placed
             if e.rank_nodes != list(placement.rank_nodes[e.cell_index])]
    wrong += [f"engine {e.engine_index} on node {e.node}, planned {planned_engines.get(e.engine_index, 'none')}"
              for e in engines if e.node != planned_engines.get(e.engine_index)]
    missing = sorted(set(range(len(placement.rank_nodes))) - {e.cell_index for e in placed})
    missing_engines = sorted(set(planned_engines) - {e.engine_index for e in engines})
    problems = (wrong + ([f"no placement event for cells {missing}"] if missing else [])
                + ([f"no placement event for engines {missing_engines}"] if missing_engines else []))
    layout = ", ".join(f"node {n}: " + (f"engines {placement.engines_on(n)}" if n in placement.rollout_nodes
                                         else f"cells {placement.cells_on(n)}") for n in range(placement.nodes))
    found = "; ".join(problems) if problems else f"{len(placed) + len(engines)} placements on planned nodes"
    return CheckResult(name, not problems, f"{found}; {layout}",
                       {"placements": [e.model_dump(mode="json") for e in placed],
                        "engine_placements": [e.model_dump(mode="json") for e in engines]})


def check_faults(events_dir: Path, expected: int, name: str) -> CheckResult:
    """Every planned crash must have fired (a fault_injected event), and no unplanned one."""
    fired = [e for e in read_events(events_dir) if isinstance(e, FaultInjectedEvent)]
    ok = len(fired) == expected
    return CheckResult(name, ok, f"{len(fired)} injected fault(s), expected {expected}",
                       {"fired": [e.model_dump(mode="json") for e in fired]})
