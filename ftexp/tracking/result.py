"""``result.json``: the one-line-per-run facts a sweep summary and trackers need.

Every run writes it next to its report, so a sweep needs no job return values (sweep jobs return
only through their result pickles): the summary reads each point's file from disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftexp.audit.events import CellReconfigureEvent, FaultInjectedEvent, read_events
from ftexp.rundir import INJECTIONS_FILE, RESULT_FILE, TARGET


def _target_events(run_dir: Path) -> list[Any]:
    """All target events, each once (a resumed phase starts from a copy of the earlier phase's log)."""
    seen, events = set(), []
    for events_dir in sorted((run_dir / TARGET).glob("**/events")):
        for e in read_events(events_dir):
            key = e.model_dump_json()
            if key not in seen:
                seen.add(key)
                events.append(e)
    return events


def build_result(run_dir: Path, verdict, overrides: list[str], wall_time_s: float,
                 final_metrics: dict[str, float]) -> dict[str, Any]:
    events = _target_events(run_dir)
    # Planned crashes log a fault event; a soak's random injections are listed by the harness.
    faults = sum(isinstance(e, FaultInjectedEvent) for e in events) + sum(
        len(json.loads(p.read_text())) for p in (run_dir / TARGET).glob(f"**/{INJECTIONS_FILE}"))
    return {
        "run_dir": str(run_dir),
        "scenario": verdict.scenario,
        "mode": verdict.mode,
        "passed": verdict.passed,
        "overrides": overrides,
        "failed_checks": [c.name for c in verdict.checks if not c.passed],
        "injections": faults,
        "heals": sum(isinstance(e, CellReconfigureEvent) and bool(e.healed_cell_indices) for e in events),
        "final_metrics": final_metrics,
        "wall_time_s": round(wall_time_s, 1),
    }


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    tmp = run_dir / (RESULT_FILE + ".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(run_dir / RESULT_FILE)
