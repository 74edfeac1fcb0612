"""ft_random: a chaos soak — what it must prove.

Not a comparison (only the target trains): the target must finish every rollout while random cells die, the injector
must have landed at least ``min_injections`` faults, the group must have healed at least
``min_heals`` times, and every analyzer rule must hold on the event log. The report lists each
injection's timeline (``recovery_rows``) and, per fault kind and over all injections
(``recovery_figures``), median and max detection and recovery and the rollouts trained with fewer
cells than configured per injection; ``soak_result`` is the part of that a sweep summary pools.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from pathlib import Path

from ftexp.audit.events import CellLifecycleEvent, CellReconfigureEvent, TrainGroupStepEndEvent, read_events
from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.rundir import TARGET, SideDir, side_dir
from ftexp.scenarios.base import Kind
from ftexp.scenarios.checks import check_event_rules, check_target_commits
from ftexp.verify.report import CheckResult

KIND = Kind.soak


def check_plan(cfg: ExperimentConfig) -> None:
    """The injector reaches the cells through the control server; scripted actions would muddle the count."""
    if not cfg.scenario.control.enabled:
        raise InputError(f"scenario {cfg.scenario.name}: a soak injects through the control server: "
                         f"set scenario.control.enabled=true")
    if any(p.target_actions for p in cfg.scenario.phases):
        raise InputError(f"scenario {cfg.scenario.name}: a soak's faults are random; it takes no target_actions")


def _injections(side: SideDir) -> list[dict]:
    path = side.injections
    return json.loads(path.read_text()) if path.is_file() else []


def _seconds(start: dt.datetime, event) -> float | None:
    return round((event.timestamp - start).total_seconds(), 2) if event is not None else None


def recovery_rows(side: SideDir) -> list[dict]:
    """Per injection, its timeline: injected → detected → suspended → relaunch requested → allocated → healed.

    Each step is the first event after the injection (and after the step before it) for the
    injected cell: ``detected`` — the driver saw a call on it fail, the control plane suspended it
    (heartbeats found it unhealthy), a committed step lists it as errored, or a reconfigure leaves it out; ``suspended`` / ``relaunch_requested`` — the
    control plane stopped it (only a frozen cell needs that: the driver stops a cell whose call
    failed itself) / asked for it to be started again; ``allocated`` — its new ranks were up
    (the heal's allocation time); ``healed`` — the reconfigure that brought it back. Seconds count
    from the injection; a missing step is None, so a slow recovery shows where it waited. Also
    how many rollouts committed with fewer cells than configured while the cell was out.
    """
    events = sorted(read_events(side.events), key=lambda e: e.timestamp)
    reconfigures = [e for e in events if isinstance(e, CellReconfigureEvent)]
    step_ends = [e for e in events if isinstance(e, TrainGroupStepEndEvent)]
    lifecycle = [e for e in events if isinstance(e, CellLifecycleEvent)]
    rows = []
    for inj in _injections(side):
        at = dt.datetime.fromisoformat(inj["timestamp"])
        cell = int(inj["cell"].rsplit("-", 1)[1])
        heal = next((e for e in reconfigures if e.timestamp > at and cell in e.healed_cell_indices), None)
        out = [e for e in lifecycle if e.timestamp > at and e.cell_index == cell and e.transition in ("failed", "stopped")]
        out += [e for e in step_ends if e.timestamp > at and e.cell_outcomes.get(cell) == "error"]
        out += [e for e in reconfigures if e.timestamp > at and cell not in e.alive_cell_indices_after]
        detected = min(out + ([heal] if heal else []), key=lambda e: e.timestamp, default=None)

        def next_transition(kind: str, after: dt.datetime | None):
            return next((e for e in lifecycle if after is not None and e.timestamp >= after and e.cell_index == cell
                         and e.transition == kind), None)

        # A cell whose call failed is stopped by the driver itself; only a frozen one is suspended.
        suspended = next_transition("stopped", at)
        relaunch = next_transition("start_requested", at)
        allocated_s = None
        if heal is not None and "allocate_s" in heal.timings:
            allocated_at = heal.timestamp - dt.timedelta(seconds=heal.timings["reconfigure_total_s"] - heal.timings["allocate_s"])
            allocated_s = round((allocated_at - at).total_seconds(), 2)
        degraded = [e.rollout_id for e in step_ends if e.timestamp > at and (heal is None or e.timestamp < heal.timestamp)
                    and cell not in e.cell_outcomes]
        rows.append({**inj, "detection_s": _seconds(at, detected), "suspended_s": _seconds(at, suspended),
                     "relaunch_requested_s": _seconds(at, relaunch), "allocated_s": allocated_s,
                     "recovery_s": _seconds(at, heal), "healed_at_rollout": heal.rollout_id if heal else None,
                     "degraded_rollouts": len(degraded)})
    return rows


def recovery_figures(rows: list[dict]) -> dict[str, float | int | None]:
    """Of these injections: median and max detection and recovery seconds (over those that got
    there) and the rollouts trained with fewer cells than configured, per injection (mean, max)."""
    entry: dict[str, float | int | None] = {"injections": len(rows)}
    for key in ("detection_s", "recovery_s"):
        values = [r[key] for r in rows if r[key] is not None]
        entry[f"median_{key}"] = round(statistics.median(values), 2) if values else None
        entry[f"max_{key}"] = max(values) if values else None
    degraded = [r["degraded_rollouts"] for r in rows]
    entry["mean_degraded_rollouts"] = round(statistics.mean(degraded), 2) if degraded else None
    entry["max_degraded_rollouts"] = max(degraded) if degraded else None
    return entry


def figures_by_kind(rows: list[dict]) -> dict[str, dict[str, float | int | None]]:
    """``recovery_figures`` per fault kind."""
    return {mode: recovery_figures([r for r in rows if r["mode"] == mode]) for mode in sorted({r["mode"] for r in rows})}


def soak_result(side: SideDir) -> dict | None:
    """For ``result.json``: each injection's kind, detection, recovery and degraded rollouts (None: not a soak)."""
    if not side.injections.is_file():
        return None
    keys = ("mode", "detection_s", "recovery_s", "degraded_rollouts")
    return {"injections": [{k: row[k] for k in keys} for row in recovery_rows(side)]}


def _figures_line(name: str, f: dict) -> str:
    return (f"{name}: detection median {f['median_detection_s']} / max {f['max_detection_s']} s, "
            f"recovery median {f['median_recovery_s']} / max {f['max_recovery_s']} s, "
            f"degraded rollouts per injection mean {f['mean_degraded_rollouts']} / max {f['max_degraded_rollouts']}")


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    soak = cfg.scenario.soak
    target = side_dir(run_dir, TARGET, "")
    events = read_events(target.events)
    heals = [e for e in events if isinstance(e, CellReconfigureEvent) and e.healed_cell_indices]
    rows = recovery_rows(target)
    modes = sorted({r["mode"] for r in rows})
    by_kind, overall = figures_by_kind(rows), recovery_figures(rows)
    return [
        check_target_commits(target.events, list(range(cfg.scenario.num_rollout)), "target_commits"),
        CheckResult("injections", len(rows) >= soak.min_injections,
                    f"{len(rows)} accepted injections (modes {modes}), need >= {soak.min_injections}; "
                    + "; ".join(_figures_line(name, f) for name, f in [("all", overall), *by_kind.items()]),
                    {"recoveries": rows, "by_kind": by_kind, "overall": overall}),
        CheckResult("heals", len(heals) >= soak.min_heals,
                    f"{len(heals)} healing reconfigurations, need >= {soak.min_heals}",
                    {"heals": [{"rollout_id": h.rollout_id, "healed": h.healed_cell_indices, **h.timings} for h in heals]}),
        check_event_rules(target.events, "target_event_analyzer", audit=cfg.trainer.audit,
                          expect_witness=cfg.trainer.witness_on),
    ]
