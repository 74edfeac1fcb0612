"""Tensor-by-tensor comparison of two dump trees (baseline vs target), fail closed.

A dump tree (see ``ftexp.audit.dumps``) holds leaf dirs such as ``fwd_bwd/rollout_3/``, each a
flat set of one-tensor ``.pt`` files. Both trees must have the same, non-empty set of leaves.
Within a leaf, files are matched by their *grouping key*: every file-name field except
``dump_index``, ``filename`` and the grouping-skip keys (``rank``, ``dp``, ``edp`` by default),
because the two runs have different data-parallel layouts but the same tensor names and
pp/tp/cp/ep coordinates.

Each matched pair is judged by the first threshold rule whose regex fully matches the tensor
name (``[(regex, predicate), ...]``, see ``predicate``). Every tensor ends up as one record:

- ``passed``          the rule's predicate holds;
- ``failed``          it does not: a failure;
- ``failed-allowed``  it does not, but the name matches ``allow_failed_pattern``: not a failure;
- ``skipped``         present on one side only: a failure unless ``allow_skipped_pattern`` matches;
- ``errored``         no rule matches, shapes differ, or one side holds duplicates: a failure.

Tensors matching ``exclude_pattern`` (e.g. witness tensors) are ignored entirely. Bad rules,
missing roots and unreadable dump files raise InputError: bad input, not a verdict.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from ftexp.audit.dumps import DumpFile, list_dump_files, load_dump
from ftexp.errors import InputError
from ftexp.verify.predicate import Predicate, parse_predicate
from ftexp.verify.report import CheckResult
from ftexp.verify.tensor_diff import tensor_diff

STATUSES = ("passed", "failed", "failed-allowed", "skipped", "errored")
# Always ignored when matching: the dump's position in the writer's sequence and its file name.
_NEVER_GROUPED = ("dump_index", "filename")

GroupKey = tuple[tuple[str, str], ...]
RuleSpec = tuple[str, Union[str, Predicate]]


@dataclass(frozen=True)
class ThresholdRule:
    pattern: re.Pattern[str]
    predicate: Predicate

    @property
    def regex(self) -> str:
        return self.pattern.pattern


def compile_pattern(regex: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except (re.error, TypeError) as e:
        raise InputError(f"{what}: bad regex {regex!r}: {e}") from e


def parse_rules(rules: Sequence[RuleSpec]) -> list[ThresholdRule]:
    """Compile every (regex, predicate) pair up front, so a bad rule fails before any file is read."""
    parsed = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise InputError(f"threshold rule #{i} must be a (regex, predicate) pair, got {rule!r}")
        regex, predicate = rule
        if not isinstance(predicate, Predicate):
            predicate = parse_predicate(predicate)
        parsed.append(ThresholdRule(compile_pattern(regex, f"threshold rule #{i}"), predicate))
    return parsed


@dataclass
class DumpRecord:
    leaf: str
    name: str
    key: dict[str, str]  # the grouping key: name, step and parallel coordinates
    status: str  # one of STATUSES
    failure: bool  # whether this record fails the comparison
    rel: float | None = None
    max_abs: float | None = None
    mean_abs: float | None = None
    rule: str | None = None  # regex of the rule that judged it
    predicate: str | None = None
    message: str = ""

    def describe(self) -> str:
        coords = ", ".join(f"{k}={v}" for k, v in self.key.items() if k != "name")
        head = f"{self.leaf}: {self.name} [{coords}] {self.status}"
        if self.rel is None:
            return f"{head}: {self.message}"
        return (f"{head}: rel={self.rel:.6g} max_abs={self.max_abs:.6g} mean_abs={self.mean_abs:.6g} "
                f"against rule {self.rule!r} -> {self.predicate!r}")


@dataclass
class DumpComparison:
    baseline_root: Path
    target_root: Path
    leaves: list[str]  # leaves present on both sides, i.e. compared
    records: list[DumpRecord] = field(default_factory=list)
    issues: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.issues

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(r.status for r in self.records)
        return {status: counted[status] for status in STATUSES}

    def worst(self, n: int) -> list[DumpRecord]:
        """The ``n`` compared records with the highest rel; NaN ranks worst of all."""
        measured = [r for r in self.records if r.rel is not None]
        return sorted(measured, key=lambda r: math.inf if math.isnan(r.rel) else r.rel, reverse=True)[:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; rel/max_abs/mean_abs may be NaN (``report.json_safe`` encodes it)."""
        return {
            "passed": self.passed,
            "baseline_root": str(self.baseline_root),
            "target_root": str(self.target_root),
            "leaves": self.leaves,
            "counts": self.counts,
            "issues": self.issues,
            "records": [asdict(r) for r in self.records],
        }

    def to_check(self, name: str = "dumps", worst_n: int = 10) -> CheckResult:
        """A report check: summary counts, the worst tensors and every record that did not pass."""
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)
        summary = f"{len(self.leaves)} leaves, {counts or 'no tensors'}; {len(self.issues)} issues"
        details = {
            "kind": "dumps",
            "leaves": self.leaves,
            "counts": self.counts,
            "issues": self.issues,
            "worst": [asdict(r) for r in self.worst(worst_n)],
            "not_passed": [asdict(r) for r in self.records if r.status != "passed"],
        }
        return CheckResult(name, self.passed, summary, details)


def leaf_set(root: str | Path) -> list[str]:
    """Sorted leaf dirs under ``root``: parents of ``**/*.pt``, relative posix paths ("." for root)."""
    root = Path(root)
    return sorted({p.parent.relative_to(root).as_posix() for p in root.rglob("*.pt") if p.is_file()})


def _group(leaf_dir: Path, skip: frozenset[str], exclude: re.Pattern[str] | None) -> dict[GroupKey, list[DumpFile]]:
    try:
        files = list_dump_files(leaf_dir)
    except ValueError as e:  # a foreign .pt with a malformed name
        raise InputError(f"{leaf_dir}: {e}") from e
    groups: dict[GroupKey, list[DumpFile]] = {}
    for f in files:
        if exclude is not None and exclude.fullmatch(f.name):
            continue
        key = tuple(sorted((k, v) for k, v in f.meta.items() if k not in skip))
        groups.setdefault(key, []).append(f)
    return groups


def _load(f: DumpFile):
    try:
        return load_dump(f.path)
    except ValueError as e:
        raise InputError(str(e)) from e


@dataclass(frozen=True)
class _LeafComparer:
    """Compares one leaf at a time with the settings shared by all leaves."""

    rules: list[ThresholdRule]
    skip: frozenset[str]  # file-name fields left out of the grouping key
    exclude: re.Pattern[str] | None
    allow_skipped: re.Pattern[str] | None
    allow_failed: re.Pattern[str] | None

    @staticmethod
    def _allowed(pattern: re.Pattern[str] | None, name: str) -> bool:
        return pattern is not None and pattern.fullmatch(name) is not None

    def compare(self, leaf: str, baseline_dir: Path, target_dir: Path) -> list[DumpRecord]:
        baseline = _group(baseline_dir, self.skip, self.exclude)
        target = _group(target_dir, self.skip, self.exclude)
        return [self._record(leaf, key, baseline.get(key, []), target.get(key, []))
                for key in sorted(baseline.keys() | target.keys())]

    def _record(self, leaf: str, key: GroupKey, b_files: list[DumpFile], t_files: list[DumpFile]) -> DumpRecord:
        key_dict = dict(key)
        name = key_dict["name"]

        def record(status: str, failure: bool, message: str = "", **fields: Any) -> DumpRecord:
            return DumpRecord(leaf, name, key_dict, status, failure, message=message, **fields)

        for side, files in (("baseline", b_files), ("target", t_files)):
            if len(files) > 1:
                names = ", ".join(f.path.name for f in files)
                return record("errored", True, f"{len(files)} dumps with the same key in {side}: {names}")
        if not b_files or not t_files:
            side = "baseline" if b_files else "target"
            if self._allowed(self.allow_skipped, name):
                return record("skipped", False, f"only in {side} (allowed by allow_skipped_pattern)")
            return record("skipped", True, f"only in {side}")
        rule = next((r for r in self.rules if r.pattern.fullmatch(name)), None)
        if rule is None:
            return record("errored", True, f"no threshold rule matches {name!r}; add a catch-all '.*'")
        judged_by = {"rule": rule.regex, "predicate": rule.predicate.text}
        try:
            diff = tensor_diff(_load(b_files[0]), _load(t_files[0]))
        except ValueError as e:  # shape mismatch
            return record("errored", True, str(e), **judged_by)
        numbers = {"rel": diff.rel, "max_abs": diff.max_abs, "mean_abs": diff.mean_abs}
        if rule.predicate.evaluate(diff.rel, diff.max_abs, diff.mean_abs):
            return record("passed", False, **numbers, **judged_by)
        if self._allowed(self.allow_failed, name):
            return record("failed-allowed", False, "allowed by allow_failed_pattern", **numbers, **judged_by)
        return record("failed", True, **numbers, **judged_by)


def compare_dumps(
    baseline_root: str | Path,
    target_root: str | Path,
    rules: Sequence[RuleSpec],
    *,
    phase_subdir: str | None = None,
    exclude_pattern: str | None = None,
    allow_skipped_pattern: str | None = None,
    allow_failed_pattern: str | None = None,
    grouping_skip_keys: Sequence[str] = ("rank", "dp", "edp"),
) -> DumpComparison:
    """Compare every tensor of ``<baseline_root>/<phase_subdir>`` with its twin under the target root."""
    parsed_rules = parse_rules(rules)
    if "rank" not in grouping_skip_keys:
        # The two runs write from different global ranks; grouping on rank would match nothing.
        raise InputError(f"grouping_skip_keys must include 'rank', got {list(grouping_skip_keys)}")
    comparer = _LeafComparer(
        parsed_rules,
        frozenset(_NEVER_GROUPED) | frozenset(grouping_skip_keys),
        compile_pattern(exclude_pattern, "threshold.exclude_pattern") if exclude_pattern is not None else None,
        compile_pattern(allow_skipped_pattern, "threshold.allow_skipped_pattern") if allow_skipped_pattern is not None else None,
        compile_pattern(allow_failed_pattern, "threshold.allow_failed_pattern") if allow_failed_pattern is not None else None,
    )
    roots = {}
    for side, root in (("baseline", baseline_root), ("target", target_root)):
        roots[side] = Path(root) / (phase_subdir or "")
        if not roots[side].is_dir():
            raise InputError(f"{side} dump root {roots[side]} does not exist")

    baseline_leaves, target_leaves = leaf_set(roots["baseline"]), leaf_set(roots["target"])
    common = sorted(set(baseline_leaves) & set(target_leaves))
    result = DumpComparison(roots["baseline"], roots["target"], common)
    if not baseline_leaves:
        result.issues.append(f"baseline has no dumps under {roots['baseline']}: nothing to compare")
    result.issues += [f"leaf {leaf} missing in target" for leaf in sorted(set(baseline_leaves) - set(target_leaves))]
    result.issues += [f"leaf {leaf} only in target" for leaf in sorted(set(target_leaves) - set(baseline_leaves))]
    for leaf in common:
        records = comparer.compare(leaf, roots["baseline"] / leaf, roots["target"] / leaf)
        result.records += records
        result.issues += [r.describe() for r in records if r.failure]
    return result
