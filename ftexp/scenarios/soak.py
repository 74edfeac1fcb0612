"""What a chaos soak (``ft_random``) must prove (spec §14.4, §15.6).

Not a comparison: the target must finish every rollout while random cells die, the injector
must have landed at least ``min_injections`` faults, the group must have healed at least
``min_heals`` times, and every analyzer rule must hold on the event log. The report lists each
injection with the time until its cell was healed back into the quorum.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from ftexp.audit.events import CellReconfigureEvent, read_events
from ftexp.config import ExperimentConfig
from ftexp.faults.soak import INJECTIONS_FILE
from ftexp.scenarios.checks import check_event_rules, check_target_commits
from ftexp.verify.report import CheckResult


def _injections(side_dir: Path) -> list[dict]:
    path = side_dir / INJECTIONS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def recovery_rows(side_dir: Path) -> list[dict]:
    """Per injection: the first later heal that brought its cell back, and how long that took."""
    heals = sorted((e for e in read_events(side_dir / "events")
                    if isinstance(e, CellReconfigureEvent) and e.healed_cell_indices), key=lambda e: e.timestamp)
    rows = []
    for inj in _injections(side_dir):
        at = dt.datetime.fromisoformat(inj["timestamp"])
        cell = int(inj["cell"].rsplit("-", 1)[1])
        heal = next((h for h in heals if h.timestamp > at and cell in h.healed_cell_indices), None)
        rows.append({**inj, "healed_at_rollout": heal.rollout_id if heal else None,
                     "recovery_s": round((heal.timestamp - at).total_seconds(), 2) if heal else None})
    return rows


def verify_soak(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    soak = cfg.scenario.soak
    side_dir = run_dir / "target"
    events = read_events(side_dir / "events")
    heals = [e for e in events if isinstance(e, CellReconfigureEvent) and e.healed_cell_indices]
    rows = recovery_rows(side_dir)
    modes = sorted({r["mode"] for r in rows})
    return [
        check_target_commits(side_dir / "events", list(range(cfg.scenario.num_rollout)), "target_commits"),
        CheckResult("injections", len(rows) >= soak.min_injections,
                    f"{len(rows)} accepted injections (modes {modes}), need >= {soak.min_injections}",
                    {"recoveries": rows}),
        CheckResult("heals", len(heals) >= soak.min_heals,
                    f"{len(heals)} healing reconfigurations, need >= {soak.min_heals}",
                    {"heals": [{"rollout_id": h.rollout_id, "healed": h.healed_cell_indices, **h.timings} for h in heals]}),
        check_event_rules(side_dir / "events", "target_event_analyzer", expect_witness=cfg.trainer.enable_witness),
    ]
