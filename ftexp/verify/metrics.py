"""Metric-by-metric comparison of two runs' logged metrics, rollout by rollout, fail closed.

Each side's ``MetricEvent``s are read from its events dir. A rollout may have been attempted more
than once (a fault discards an attempt and the group retries), so per rollout id only the events
of the highest attempt count (a missing attempt counts as 0; rollout id None is a rollout of its
own); their ``metrics`` dicts are merged into one dict per rollout.

The two sides must have the same rollout ids. Every key that starts with one of ``key_prefixes``
and is not excluded is then compared value by value, in both directions (a key on one side only is
an issue). Numbers are equal within tolerance when::

    both exactly 0,  or  |b − t| <= atol,  or  |b − t| / max(|b|, |t|, 1e-12) <= rtol

NaN on either side is always an issue and infinities must be equal. A null (None) value on either
side is an issue too: the event logger's JSON encoding writes NaN and ±inf as null, so a null may
be a NaN in disguise. Other non-numeric values (strings, lists) are listed but not compared.

The ``required_keys`` must appear in some compared baseline rollout, so that a run which logged
nothing of substance cannot pass.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from ftexp.audit.events import MetricEvent
from ftexp.errors import InputError
from ftexp.verify._io import read_typed_events
from ftexp.verify.report import CheckResult

RolloutId = int | None
_REL_FLOOR = 1e-12  # keeps the relative difference finite when both values are tiny
_NULL_NOTE = "null value (the event log's JSON writes NaN and inf as null)"


@dataclass
class MetricRow:
    rollout_id: RolloutId
    key: str
    baseline: Any
    target: Any
    abs_diff: float | None
    rel_diff: float | None
    ok: bool
    note: str = ""


def _rollout_order(rollout_id: RolloutId) -> tuple[bool, int]:
    return (rollout_id is not None, rollout_id or 0)


@dataclass
class MetricComparison:
    rows: list[MetricRow]
    issues: list[str]
    # Per side: rollout id -> merged metrics of its final attempt (all keys, as logged).
    baseline: dict[RolloutId, dict[str, Any]] = field(default_factory=dict)
    target: dict[RolloutId, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.issues

    def series(self, side: Literal["baseline", "target"]) -> dict[str, list[tuple[int, float]]]:
        """Per compared key, the (rollout_id, value) points of one side, for plotting.

        Only numeric values of keys that appear in ``rows`` and rollouts with an id are included.
        """
        if side not in ("baseline", "target"):
            raise ValueError(f"side must be 'baseline' or 'target', got {side!r}")
        rollouts = self.baseline if side == "baseline" else self.target
        keys = sorted({row.key for row in self.rows})
        out: dict[str, list[tuple[int, float]]] = {}
        for key in keys:
            points = [(rid, float(m[key])) for rid, m in rollouts.items()
                      if rid is not None and _is_number(m.get(key))]
            if points:
                out[key] = sorted(points)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; values may be NaN (``report.json_safe`` encodes it)."""
        return {
            "passed": self.passed,
            "issues": self.issues,
            "rollouts": {"baseline": sorted(self.baseline, key=_rollout_order),
                         "target": sorted(self.target, key=_rollout_order)},
            "rows": [asdict(r) for r in self.rows],
        }

    def to_check(self, name: str = "metrics") -> CheckResult:
        compared = sum(1 for r in self.rows if r.abs_diff is not None)
        summary = (f"{len(set(self.baseline) & set(self.target))} rollouts, {compared} values compared; "
                   f"{len(self.issues)} issues")
        return CheckResult(name, self.passed, summary, {"kind": "metrics", **self.to_dict()})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, bool))


def _same(a: Any, b: Any) -> bool:
    """Equality in which NaN equals NaN: logging the same NaN twice is not a conflict."""
    both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return both_nan or a == b


def _final_attempts(events: list[MetricEvent], side: str, compared: Callable[[str], bool],
                    issues: list[str]) -> dict[RolloutId, dict[str, Any]]:
    """Merge the metrics of each rollout's highest attempt; conflicting compared keys are issues."""
    final_attempt: dict[RolloutId, int] = {}
    for e in events:
        final_attempt[e.rollout_id] = max(final_attempt.get(e.rollout_id, 0), e.attempt or 0)
    merged: dict[RolloutId, dict[str, Any]] = {}
    for e in events:
        if (e.attempt or 0) != final_attempt[e.rollout_id]:
            continue  # a discarded attempt: its metrics never committed
        metrics = merged.setdefault(e.rollout_id, {})
        for key, value in e.metrics.items():
            if key in metrics and compared(key) and not _same(metrics[key], value):
                issues.append(f"{side} rollout {e.rollout_id}: {key} logged twice with different values "
                              f"{metrics[key]!r} and {value!r}")
                continue
            metrics.setdefault(key, value)
    return merged


def _compare_values(b: Any, t: Any, rtol: float, atol: float) -> tuple[bool, float | None, float | None, str]:
    """(ok, abs_diff, rel_diff, note) for one baseline/target value pair."""
    if b is None or t is None:
        return False, None, None, _NULL_NOTE
    if not (_is_number(b) and _is_number(t)):
        return True, None, None, "non-numeric; not compared"
    b, t = float(b), float(t)
    if math.isnan(b) or math.isnan(t):
        return False, math.nan, math.nan, "NaN"
    if math.isinf(b) or math.isinf(t):
        return (True, 0.0, 0.0, "") if b == t else (False, math.inf, math.inf, "infinite values differ")
    abs_diff = abs(b - t)
    rel_diff = abs_diff / max(abs(b), abs(t), _REL_FLOOR)
    if (b == 0 and t == 0) or abs_diff <= atol:
        return True, abs_diff, rel_diff, ""
    return rel_diff <= rtol, abs_diff, rel_diff, "" if rel_diff <= rtol else f"rel_diff > rtol {rtol:g}"


def compare_metrics(
    baseline_events_dir: str | Path,
    target_events_dir: str | Path,
    *,
    rtol: float,
    atol: float,
    key_prefixes: Sequence[str],
    exclude_keys: Sequence[str] = (),
    required_keys: Sequence[str] = ("train/loss", "train/grad_norm"),
) -> MetricComparison:
    """Compare the final-attempt metrics of two runs; see the module docstring for the rules."""
    if isinstance(key_prefixes, str) or not key_prefixes:
        raise InputError(f"key_prefixes must be a non-empty list of prefixes, got {key_prefixes!r}")
    for label, value in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(value, (int, float)) and value >= 0):  # also rejects NaN
            raise InputError(f"{label} must be a number >= 0, got {value!r}")
    excluded = set(exclude_keys)

    def compared(key: str) -> bool:
        return key.startswith(tuple(key_prefixes)) and key not in excluded

    uncompared = [k for k in required_keys if not compared(k)]
    if uncompared:
        # A required key outside the compared set would be checked for presence but never for value.
        raise InputError(f"required metric keys {uncompared} are not covered by key_prefixes "
                         f"{list(key_prefixes)} (or are excluded)")

    issues: list[str] = []
    sides = {}
    for side, events_dir in (("baseline", baseline_events_dir), ("target", target_events_dir)):
        events = read_typed_events(events_dir, MetricEvent)
        if not events:
            issues.append(f"{side} has no metric events in {events_dir}")
        sides[side] = _final_attempts(events, side, compared, issues)
    baseline, target = sides["baseline"], sides["target"]
    result = MetricComparison([], issues, baseline, target)

    missing = sorted(set(baseline) - set(target), key=_rollout_order)
    extra = sorted(set(target) - set(baseline), key=_rollout_order)
    if missing:
        issues.append(f"rollouts {missing} have metrics in baseline but not in target")
    if extra:
        issues.append(f"rollouts {extra} have metrics in target but not in baseline")
    common = sorted(set(baseline) & set(target), key=_rollout_order)

    for rid in common:
        b_metrics, t_metrics = baseline[rid], target[rid]
        for key in sorted(k for k in b_metrics if compared(k)):
            if key not in t_metrics:
                result.rows.append(MetricRow(rid, key, b_metrics[key], None, None, None, False, "missing in target"))
                issues.append(f"rollout {rid}: {key} missing in target")
                continue
            ok, abs_diff, rel_diff, note = _compare_values(b_metrics[key], t_metrics[key], rtol, atol)
            result.rows.append(MetricRow(rid, key, b_metrics[key], t_metrics[key], abs_diff, rel_diff, ok, note))
            if not ok:
                diffs = "" if abs_diff is None else f" (abs_diff={abs_diff:.6g}, rel_diff={rel_diff:.6g})"
                issues.append(f"rollout {rid}: {key} baseline={b_metrics[key]!r} "
                              f"target={t_metrics[key]!r}{diffs}: {note}")
        for key in sorted(k for k in t_metrics if compared(k) and k not in b_metrics):
            result.rows.append(MetricRow(rid, key, None, t_metrics[key], None, None, False, "missing in baseline"))
            issues.append(f"rollout {rid}: {key} logged by target but missing in baseline")

    for key in required_keys:
        if not any(key in baseline[rid] for rid in common):
            issues.append(f"required metric {key} appears in no compared baseline rollout")
    return result
