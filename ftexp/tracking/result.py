"""``result.json``: the one-line-per-run facts a sweep summary and trackers need.

Every run writes it next to its report, so a sweep needs no job return values (sweep jobs return
only through their result pickles): the summary reads each point's file from disk. ``status`` is
the report's: PASSED or FAILED once a verification completed, else ERROR or INTERRUPTED with the
one-line ``cause`` (``write_status_result``); only PASSED counts as a pass. A soak's result also
carries each injection's kind, detection, recovery and degraded rollouts (``soak``), which the
sweep summary pools per crash probability.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftexp.audit.events import CellReconfigureEvent, FaultInjectedEvent, read_events
from ftexp.errors import file_error
from ftexp.rundir import INJECTIONS_FILE, RESULT_FILE, TARGET, side_dir
from ftexp.scenarios.ft_random import soak_result
from ftexp.verify.report import FAILED, PASSED, write_text_atomic

__all__ = ["RESULT_FILE", "build_result", "result_passed", "write_result", "write_status_result"]


def _target_events(run_dir: Path) -> list[Any]:
    """All target events, each once (a resumed phase starts from a copy of the earlier phase's log).

    Not strict: the verdict's checks already read these logs strictly; a training job that failed
    may have left a cut line, which must not keep its FAILED verdict from being written.
    """
    seen, events = set(), []
    for events_dir in sorted((run_dir / TARGET).glob("**/events")):
        for e in read_events(events_dir, strict=False):
            key = e.model_dump_json()
            if key not in seen:
                seen.add(key)
                events.append(e)
    return events


def _injections(run_dir: Path) -> int:
    total = 0
    for path in (run_dir / TARGET).glob(f"**/{INJECTIONS_FILE}"):
        try:
            total += len(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            raise file_error(path, e, "injections file") from e
    return total


def build_result(run_dir: Path, verdict, overrides: list[str], wall_time_s: float,
                 final_metrics: dict[str, float]) -> dict[str, Any]:
    events = _target_events(run_dir)
    # Planned crashes log a fault event; a soak's random injections are listed by the harness.
    faults = sum(isinstance(e, FaultInjectedEvent) for e in events) + _injections(run_dir)
    soak = soak_result(side_dir(run_dir, TARGET, ""))
    return {
        "run_dir": str(run_dir),
        "scenario": verdict.scenario,
        "mode": verdict.mode,
        "passed": verdict.passed,
        "status": PASSED if verdict.passed else FAILED,
        "overrides": overrides,
        "failed_checks": [c.name for c in verdict.checks if not c.passed],
        "injections": faults,
        "heals": sum(isinstance(e, CellReconfigureEvent) and bool(e.healed_cell_indices) for e in events),
        "final_metrics": final_metrics,
        "wall_time_s": round(wall_time_s, 1),
        **({"soak": soak} if soak is not None else {}),
    }


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    write_text_atomic(Path(run_dir) / RESULT_FILE, json.dumps(result, indent=2, default=str))


def write_status_result(run_dir: Path, status: str, cause: str, scenario: str, mode: str,
                        overrides: list[str], wall_time_s: float = 0.0) -> None:
    """result.json of a run without a verdict (ERROR, INTERRUPTED): not passed, and why.

    Written in place where the run dir refuses new files, so that an old PASSED is taken back."""
    result = {"run_dir": str(run_dir), "scenario": scenario, "mode": mode, "passed": False, "status": status,
              "cause": cause, "overrides": overrides, "failed_checks": [status.lower()],
              "wall_time_s": round(wall_time_s, 1)}
    write_text_atomic(Path(run_dir) / RESULT_FILE, json.dumps(result, indent=2, default=str), in_place_fallback=True)


def result_passed(result: Any) -> bool:
    """Whether a result.json's content claims a pass: ``passed`` exactly true and no other status."""
    return isinstance(result, dict) and result.get("passed") is True and result.get("status", PASSED) == PASSED
