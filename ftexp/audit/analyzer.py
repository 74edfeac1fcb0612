"""The event analyzer: rules over a run's event log that must hold at every step.

``cross_replica_weight_checksum``: every rank that committed the same (rollout, attempt) logged
hashes of its parameters, optimizer state and RNG generators (``ftexp.audit.checksums``); ranks
with the same rank-within-cell in different cells must have logged identical hashes. After a heal
this proves, bit for bit, that the healed cell received the full state (weights *and* optimizer
moments and step counts) — a dump comparison alone cannot see optimizer state. A rank of a cell
that committed normally but logged no checksum is an issue too: it would otherwise escape the
comparison (a healed cell that never logs one would pass unseen).

``inference_engine_weight_checksum_consistency``: after every weight update, all rollout engines
hold the same weights (each engine's checksums equal engine 0's, and engine 0's those of the weights
the trainer pushed), so no engine generates from a stale or differently sourced policy.

``witness``: every cell that committed a rollout must show, in its witness rows, exactly the
samples of every committed attempt so far — none missing (lost), none extra (a discarded
attempt, or a retried one, that still reached the weights). See ``witness`` below.

The driver runs the rules before every rollout (fail fast) through ``IncrementalAnalyzer``, which
reads each event once; the verifier runs the batch rules (``analyze``) again on the finished log.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, TypeVar

from ftexp.audit.events import (EventTail, InferenceEngineWeightChecksumEvent, TrainAdvantageComputationEvent,
                                TrainEngineLocalWeightChecksumEvent, TrainGroupStepEndEvent, WitnessAllocateIdEvent,
                                WitnessSnapshotParamEvent)
from ftexp.audit.witness import IdRange, count, difference, merged, ranges_of

E = TypeVar("E")
# How many ids an issue message lists before it only counts the rest.
SHOWN_IDS = 12


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


def _differing_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k, "<missing>") != b.get(k, "<missing>"))


def _describe_difference(differing: list[str]) -> str:
    """How many entries differ, per part of the state (param_hashes, optimizer_hashes, rng_hashes), and a few."""
    parts = Counter(k.split(".", 1)[0] for k in differing)
    return (f"{len(differing)} entries ({', '.join(f'{part} {n}' for part, n in sorted(parts.items()))}), "
            f"e.g. {differing[:3]}")


def _normal_cells(step: TrainGroupStepEndEvent) -> list[tuple[int, int]]:
    """(cell, number of ranks) of each cell whose every rank committed the step normally, by cell index."""
    return [(cell, len(outcome)) for cell, outcome in sorted(step.cell_outcomes.items())
            if outcome != "error" and all(o == "normal" for o in outcome)]


def _missing_checksums(step: TrainGroupStepEndEvent, logged: set[tuple[int | None, int | None]]) -> list[AnalyzerIssue]:
    """The ranks of the commit's normal cells whose (cell, rank) ``logged`` (the commit's checksum sources) lacks."""
    return [AnalyzerIssue("cross_replica_weight_checksum", step.rollout_id,
                          f"attempt {step.attempt}: cell {cell} rank {rank} committed but logged no weight checksum")
            for cell, ranks in _normal_cells(step) for rank in range(ranks) if (cell, rank) not in logged]


def cross_replica_weight_checksum(events: Iterable[Any]) -> list[AnalyzerIssue]:
    """Same-rank checksums of a (rollout, attempt) agree, and every rank of every normal cell of a commit logged
    one. A log without any checksum had the audit off: there is nothing to check."""
    groups: dict[tuple[int, int, int], list[TrainEngineLocalWeightChecksumEvent]] = defaultdict(list)
    logged: dict[tuple[int, int], set[tuple[int | None, int | None]]] = defaultdict(set)
    steps = []
    for e in events:
        if isinstance(e, TrainEngineLocalWeightChecksumEvent):
            rank = e.source.rank_within_cell if e.source.rank_within_cell is not None else -1
            groups[(e.rollout_id, e.attempt, rank)].append(e)
            logged[(e.rollout_id, e.attempt)].add((e.source.cell_index, e.source.rank_within_cell))
        elif isinstance(e, TrainGroupStepEndEvent):
            steps.append(e)
    if not groups:
        return []
    issues = [issue for step in steps for issue in _missing_checksums(step, logged[(step.rollout_id, step.attempt)])]
    for (rollout_id, attempt, _), group in sorted(groups.items()):
        ref = group[0]
        ref_state = _flatten(ref.state)
        for other in group[1:]:
            state = _flatten(other.state)
            differing = _differing_keys(ref_state, state)
            if differing:
                issues.append(AnalyzerIssue(
                    "cross_replica_weight_checksum", rollout_id,
                    f"attempt {attempt}: {ref.source.process_name} and {other.source.process_name} differ in "
                    f"{_describe_difference(differing)}"))
    return issues


def engine_checksum_issues(event: InferenceEngineWeightChecksumEvent) -> list[AnalyzerIssue]:
    """Every engine of one update against engine 0, and engine 0 against what the trainer pushed."""
    issues = []
    reference = event.engine_checksums[0] if event.engine_checksums else {}
    for index, checksums in enumerate(event.engine_checksums[1:], start=1):
        differing = _differing_keys(reference, checksums)
        if differing:
            issues.append(AnalyzerIssue(
                "inference_engine_weight_checksum_consistency", event.rollout_id,
                f"engine_{index} differs from engine_0 in {len(differing)} tensors, e.g. {differing[:3]}"))
    if event.trainer_checksums is not None and event.engine_checksums:
        differing = _differing_keys(event.trainer_checksums, reference)
        if differing:
            issues.append(AnalyzerIssue(
                "inference_engine_weight_checksum_consistency", event.rollout_id,
                f"engine_0 does not hold the trainer's weights: {len(differing)} tensors differ, e.g. {differing[:3]}"))
    return issues


def inference_engine_weight_checksum_consistency(events: Iterable[Any]) -> list[AnalyzerIssue]:
    return [issue for e in events if isinstance(e, InferenceEngineWeightChecksumEvent)
            for issue in engine_checksum_issues(e)]


def _latest_attempt(events: Iterable[E], key: Callable[[E], Hashable]) -> dict[Hashable, list[E]]:
    """Group by ``key``, keeping in each group only the events of its highest attempt."""
    groups: dict[Hashable, list[E]] = defaultdict(list)
    for e in events:
        groups[key(e)].append(e)
    latest = {k: max(e.attempt for e in g) for k, g in groups.items()}
    return {k: [e for e in g if e.attempt == latest[k]] for k, g in groups.items()}


def _show(ranges: list[IdRange]) -> str:
    """How many ids canonical ``ranges`` hold, and the first few."""
    shown: list[int] = []
    for start, stop in ranges:
        shown += range(start, min(stop, start + SHOWN_IDS - len(shown)))
    total = count(ranges)
    return f"{total} ids {shown}" + (" ..." if total > SHOWN_IDS else "")


def _zero_advantage_ids(advantage_events: list[TrainAdvantageComputationEvent],
                        issues: list[AnalyzerIssue]) -> set[int]:
    """Witness ids of samples whose every advantage is exactly 0 (their witness rows stay 0).

    A sample with no local tokens — under CP the whole response can sit on the other CP rank —
    has an empty list: it proves nothing and is not excused.
    """
    zero: set[int] = set()
    for e in advantage_events:
        for advantages, ids in zip(e.advantages, e.witness_ids):
            if len(set(ids)) > 1:
                issues.append(AnalyzerIssue("witness", e.rollout_id, f"{e.source.process_name} attempt {e.attempt}: "
                                            f"one sample's tokens carry several witness ids {sorted(set(ids))}"))
            if advantages and all(a == 0.0 for a in advantages):
                zero.add(ids[0])
    return zero


def witness(events: list[Any]) -> list[AnalyzerIssue]:
    """Every normal cell of every commit shows exactly the committed samples in each witness instance.

    Only the latest attempt counts: per rollout for allocations and advantages, per (rollout, cell)
    for snapshots (a discarded attempt's ids must never reach the weights). At rollout r:

    * expected = the ids of every rollout's latest allocation up to r (the weights accumulate);
    * excused  = zero-advantage ids, walking the rollouts in order: a rollout's new allocation first
      cancels any excuse of the ids it reuses, then its own zero-advantage ids are excused;
    * each snapshot must satisfy ``nonzero − stale == expected − stale − excused``, with ``stale``
      the slots that snapshot's step zeroed.

    A log without any witness allocation had the witness off; there is nothing to check.
    """
    allocations = _latest_attempt((e for e in events if isinstance(e, WitnessAllocateIdEvent)),
                                  key=lambda e: e.rollout_id)
    if not allocations:
        return []
    issues: list[AnalyzerIssue] = []
    allocated = {r: ranges_of(i for e in evs for i in e.witness_id_to_sample_index) for r, evs in allocations.items()}
    advantages = _latest_attempt((e for e in events if isinstance(e, TrainAdvantageComputationEvent)),
                                 key=lambda e: e.rollout_id)
    zero_advantage = {r: ranges_of(_zero_advantage_ids(evs, issues)) for r, evs in advantages.items()}
    snapshots = _latest_attempt((e for e in events if isinstance(e, WitnessSnapshotParamEvent)),
                                key=lambda e: (e.rollout_id, e.source.cell_index))

    committed, wanted = CommittedIds(), {}
    for r in sorted(allocated.keys() | zero_advantage.keys()):
        wanted[r] = committed.add(allocated.get(r, []), zero_advantage.get(r, []))

    for step in (e for e in events if isinstance(e, TrainGroupStepEndEvent)):
        r = step.rollout_id
        for cell, _ in _normal_cells(step):
            issues += _snapshot_issues(r, cell, snapshots.get((r, cell)), wanted.get(r, []))
    return issues


class CommittedIds:
    """The running ``expected`` and ``excused`` ids of the witness rule, as canonical ranges.

    A long run's expected ids are every sample it committed, tens of thousands after a few hundred
    rollouts; as ranges they are about one per excused sample or discarded attempt, so a commit costs
    the same late in a run as early.
    """

    def __init__(self) -> None:
        self.expected: list[IdRange] = []
        self.excused: list[IdRange] = []

    def add(self, new: list[IdRange], zero_advantage: list[IdRange]) -> list[IdRange]:
        """Take in a rollout's allocation and zero-advantage ids; return the ids every snapshot must show."""
        self.expected = merged(self.expected + new)
        self.excused = merged(difference(self.excused, new) + zero_advantage)
        return difference(self.expected, self.excused)


def _snapshot_issues(rollout_id: int, cell: int, snapshots: list[WitnessSnapshotParamEvent] | None,
                     want: list[IdRange]) -> list[AnalyzerIssue]:
    """A committed cell's snapshots against the ids its witness rows must show (stale slots aside)."""
    if not snapshots:
        return [AnalyzerIssue("witness", rollout_id, f"cell {cell} committed but logged no witness snapshot")]
    issues = []
    for snap in snapshots:
        stale, have = merged(snap.stale_id_ranges), merged(snap.nonzero_witness_id_ranges)
        missing = difference(difference(want, have), stale)
        extra = difference(difference(have, want), stale)
        if missing or extra:
            issues.append(AnalyzerIssue(
                "witness", rollout_id, f"cell {cell} {snap.source.process_name} {snap.instance_id} attempt "
                                       f"{snap.attempt}: missing {_show(missing)}, extra {_show(extra)}"))
    return issues


RULES = (cross_replica_weight_checksum, inference_engine_weight_checksum_consistency, witness)


def analyze(events: list[Any]) -> list[AnalyzerIssue]:
    return [issue for rule in RULES for issue in rule(events)]


def raise_on_issues(events: list[Any]) -> None:
    issues = analyze(events)
    if issues:
        raise EventAnalysisError(issues)


class IncrementalAnalyzer:
    """The rules above, fed each event of a growing log once; ``check`` returns the new issues.

    What later events can still be checked against is all it keeps: per (rollout, attempt, rank)
    the first checksum state, per (rollout, attempt) the ranks that logged a checksum, the witness
    allocations, advantages and snapshots of rollouts not yet committed, and the running
    expected/excused witness ids. A commit (step-end event) is checked when it is read — every
    event of its rollout was written before it — and its rollout's buffers are dropped, so a long
    run costs the same per rollout at its end as at its start. On a finished log it finds the same
    issues as ``analyze``.
    """

    def __init__(self, events_dir):
        self.tail = EventTail(events_dir)
        self._checksum_refs: dict[tuple[int, int, int], tuple[str, dict[str, Any]]] = {}
        self._checksum_sources: dict[tuple[int, int], set[tuple[int | None, int | None]]] = defaultdict(set)
        self._checksums_on = False  # a log with checksums had the audit on: from then on every commit needs them
        self._allocated: dict[int, dict[int, list[IdRange]]] = defaultdict(dict)  # rollout -> attempt -> ids
        self._zero_advantage: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
        self._snapshots: dict[tuple[int, int], dict[int, list[WitnessSnapshotParamEvent]]] = defaultdict(
            lambda: defaultdict(list))
        self._witness_on = False
        self._committed = CommittedIds()

    def check(self) -> list[AnalyzerIssue]:
        issues: list[AnalyzerIssue] = []
        commits = []
        for e in self.tail.read_new():
            if isinstance(e, TrainEngineLocalWeightChecksumEvent):
                issues += self._checksum(e)
            elif isinstance(e, InferenceEngineWeightChecksumEvent):
                issues += engine_checksum_issues(e)
            elif isinstance(e, WitnessAllocateIdEvent):
                self._witness_on = True
                self._allocated[e.rollout_id][e.attempt] = ranges_of(e.witness_id_to_sample_index)
            elif isinstance(e, TrainAdvantageComputationEvent):
                self._zero_advantage[e.rollout_id][e.attempt] |= _zero_advantage_ids([e], issues)
            elif isinstance(e, WitnessSnapshotParamEvent):
                self._snapshots[(e.rollout_id, e.source.cell_index)][e.attempt].append(e)
            elif isinstance(e, TrainGroupStepEndEvent):
                commits.append(e)
        for step in commits:
            issues += self._commit(step)
        return issues

    def _checksum(self, e: TrainEngineLocalWeightChecksumEvent) -> list[AnalyzerIssue]:
        rank = e.source.rank_within_cell if e.source.rank_within_cell is not None else -1
        self._checksums_on = True
        self._checksum_sources[(e.rollout_id, e.attempt)].add((e.source.cell_index, e.source.rank_within_cell))
        state = _flatten(e.state)
        ref = self._checksum_refs.setdefault((e.rollout_id, e.attempt, rank), (e.source.process_name, state))
        differing = _differing_keys(ref[1], state)
        if not differing:
            return []
        return [AnalyzerIssue("cross_replica_weight_checksum", e.rollout_id,
                              f"attempt {e.attempt}: {ref[0]} and {e.source.process_name} differ in "
                              f"{_describe_difference(differing)}")]

    def _commit(self, step: TrainGroupStepEndEvent) -> list[AnalyzerIssue]:
        r = step.rollout_id
        issues: list[AnalyzerIssue] = []
        if self._witness_on:
            attempts = self._allocated.pop(r, {})
            zero_by_attempt = self._zero_advantage.pop(r, {})
            want = self._committed.add(attempts[max(attempts)] if attempts else [],
                                       ranges_of(zero_by_attempt[max(zero_by_attempt)]) if zero_by_attempt else [])
            for cell, _ in _normal_cells(step):
                by_attempt = self._snapshots.get((r, cell))
                issues += _snapshot_issues(r, cell, by_attempt[max(by_attempt)] if by_attempt else None, want)
        if self._checksums_on:
            issues += _missing_checksums(step, self._checksum_sources.pop((r, step.attempt), set()))
        for key in [k for k in self._snapshots if k[0] <= r]:
            del self._snapshots[key]
        for key in [k for k in self._checksum_refs if k[0] < r]:
            del self._checksum_refs[key]
        for key in [k for k in self._checksum_sources if k[0] < r]:
            del self._checksum_sources[key]
        return issues
