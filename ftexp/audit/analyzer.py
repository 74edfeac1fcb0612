"""The event analyzer: rules over a run's event log that must hold at every step (spec §12).

``cross_replica_weight_checksum``: every rank that committed the same (rollout, attempt) logged
SHA-256 hashes of its parameters and optimizer state; ranks with the same rank-within-cell in
different cells must have logged identical hashes. After a heal this proves, bit for bit, that
the healed cell received the full state (weights *and* optimizer moments and step counts) —
a dump comparison alone cannot see optimizer state.

The driver runs the analyzer before every rollout (fail fast) and the verifier runs it again on
the finished log.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from ftexp.audit.events import TrainEngineLocalWeightChecksumEvent


@dataclass(frozen=True)
class AnalyzerIssue:
    rule: str
    rollout_id: int | None
    description: str

    def __str__(self) -> str:
        return f"[{self.rule}] rollout {self.rollout_id}: {self.description}"


class EventAnalysisError(RuntimeError):
    def __init__(self, issues: list[AnalyzerIssue]):
        self.issues = issues
        super().__init__("event analysis found issues: " + "; ".join(str(i) for i in issues[:5])
                         + (f" (+{len(issues) - 5} more)" if len(issues) > 5 else ""))


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k in sorted(obj, key=str):
            out.update(_flatten(obj[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: obj}


def cross_replica_weight_checksum(events: Iterable[Any]) -> list[AnalyzerIssue]:
    groups: dict[tuple[int, int, int], list[TrainEngineLocalWeightChecksumEvent]] = defaultdict(list)
    for e in events:
        if isinstance(e, TrainEngineLocalWeightChecksumEvent):
            rank = e.source.rank_within_cell if e.source.rank_within_cell is not None else -1
            groups[(e.rollout_id, e.attempt, rank)].append(e)
    issues = []
    for (rollout_id, attempt, _), group in sorted(groups.items()):
        ref = group[0]
        ref_state = _flatten(ref.state)
        for other in group[1:]:
            state = _flatten(other.state)
            differing = sorted(k for k in ref_state.keys() | state.keys() if ref_state.get(k, "<missing>") != state.get(k, "<missing>"))
            if differing:
                issues.append(AnalyzerIssue(
                    "cross_replica_weight_checksum", rollout_id,
                    f"attempt {attempt}: {ref.source.process_name} and {other.source.process_name} differ in "
                    f"{len(differing)} entries, e.g. {differing[:3]}"))
    return issues


RULES = (cross_replica_weight_checksum,)


def analyze(events: list[Any]) -> list[AnalyzerIssue]:
    return [issue for rule in RULES for issue in rule(events)]


def raise_on_issues(events: list[Any]) -> None:
    issues = analyze(events)
    if issues:
        raise EventAnalysisError(issues)
