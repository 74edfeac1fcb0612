"""Assertions on cell reconfigurations: which cells were shrunk out and healed, and when.

Every membership change of the fault-tolerant group logs a ``CellReconfigureEvent``. A scenario
knows which reconfigurations its fault plan must cause and asserts that the audit trail holds
exactly those, in order. The comparison uses ``ReconfigureInfo``, the event's meaningful
content: ``quorum_id`` is deliberately left out because its value depends on how many quorum
rounds the system ran, which is not part of the scenario's contract.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ftexp.audit.events import CellReconfigureEvent
from ftexp.verify._io import read_typed_events
from ftexp.verify.report import CheckResult


@dataclass(frozen=True)
class ReconfigureInfo:
    rollout_id: int
    src_cell_index: int | None  # the cell that sent state to the healed cells; None for a pure shrink
    healed_cell_indices: tuple[int, ...]
    alive_cell_indices_after: tuple[int, ...]

    def __post_init__(self):
        # Accept lists from callers and events alike, so that equality compares contents.
        object.__setattr__(self, "healed_cell_indices", tuple(self.healed_cell_indices))
        object.__setattr__(self, "alive_cell_indices_after", tuple(self.alive_cell_indices_after))


def reconfigure_infos(events_dir: str | Path) -> list[ReconfigureInfo]:
    """The reconfigurations logged under ``events_dir``, in read order."""
    return [
        ReconfigureInfo(e.rollout_id, e.src_cell_index, e.healed_cell_indices, e.alive_cell_indices_after)
        for e in read_typed_events(events_dir, CellReconfigureEvent)
    ]


def check_reconfigure_events(events_dir: str | Path, expected: Sequence[ReconfigureInfo],
                             name: str = "reconfigure_events") -> CheckResult:
    """Pass iff ``events_dir`` exists and its reconfigurations equal ``expected`` exactly."""
    expected = list(expected)
    details = {"kind": "reconfigure", "events_dir": str(events_dir), "expected": [asdict(i) for i in expected]}
    if not Path(events_dir).is_dir():
        # A missing dir would read as "no reconfigurations", which passes an expectation of none.
        return CheckResult(name, False, f"events dir {events_dir} does not exist", {**details, "actual": []})
    actual = reconfigure_infos(events_dir)
    details["actual"] = [asdict(i) for i in actual]
    if actual == expected:
        return CheckResult(name, True, f"{len(actual)} reconfigure events as expected", details)
    first = next((i for i, (e, a) in enumerate(zip(expected, actual)) if e != a), min(len(expected), len(actual)))
    summary = f"expected {len(expected)} reconfigure events, got {len(actual)}; first difference at #{first}"
    return CheckResult(name, False, f"{summary}: expected {expected} vs actual {actual}", details)
