"""ft_random: a chaos soak — what it must prove.

Not a comparison (only the target trains): the target must finish every rollout while random cells die, the injector
must have landed at least ``min_injections`` faults, the group must have healed at least
``min_heals`` times, and every analyzer rule must hold on the event log. The report lists each
injection with the time until its cell was healed back into the quorum.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from ftexp.audit.events import CellReconfigureEvent, TrainGroupStepEndEvent, read_events
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
    """Per injection: when the group first saw its cell gone, and when a heal brought it back.

    Detection is the first later event that shows the cell out of the quorum: a committed step
    that lists it as errored, a reconfigure that leaves it out, or the heal that brings it back.
    """
    events = sorted(read_events(side.events), key=lambda e: e.timestamp)
    reconfigures = [e for e in events if isinstance(e, CellReconfigureEvent)]
    step_ends = [e for e in events if isinstance(e, TrainGroupStepEndEvent)]
    rows = []
    for inj in _injections(side):
        at = dt.datetime.fromisoformat(inj["timestamp"])
        cell = int(inj["cell"].rsplit("-", 1)[1])
        heal = next((e for e in reconfigures if e.timestamp > at and cell in e.healed_cell_indices), None)
        out = [e for e in step_ends if e.timestamp > at and e.cell_outcomes.get(cell) == "error"]
        out += [e for e in reconfigures if e.timestamp > at and cell not in e.alive_cell_indices_after]
        seen = min(out + ([heal] if heal else []), key=lambda e: e.timestamp, default=None)
        rows.append({**inj, "detection_s": _seconds(at, seen), "healed_at_rollout": heal.rollout_id if heal else None,
                     "recovery_s": _seconds(at, heal)})
    return rows


def verify(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    soak = cfg.scenario.soak
    target = side_dir(run_dir, TARGET, "")
    events = read_events(target.events)
    heals = [e for e in events if isinstance(e, CellReconfigureEvent) and e.healed_cell_indices]
    rows = recovery_rows(target)
    modes = sorted({r["mode"] for r in rows})
    return [
        check_target_commits(target.events, list(range(cfg.scenario.num_rollout)), "target_commits"),
        CheckResult("injections", len(rows) >= soak.min_injections,
                    f"{len(rows)} accepted injections (modes {modes}), need >= {soak.min_injections}",
                    {"recoveries": rows}),
        CheckResult("heals", len(heals) >= soak.min_heals,
                    f"{len(heals)} healing reconfigurations, need >= {soak.min_heals}",
                    {"heals": [{"rollout_id": h.rollout_id, "healed": h.healed_cell_indices, **h.timings} for h in heals]}),
        check_event_rules(target.events, "target_event_analyzer", expect_witness=cfg.trainer.witness_on),
    ]
