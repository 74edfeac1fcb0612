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

Every rule must be the first match of at least one tensor, or it is a *dead rule* — a typo'd
pattern, or one shadowed by an earlier rule — and the comparison fails naming it. A rule may name a
model feature as a third element (``(regex, predicate, "moe")``): it is then required to match
only when the run's model has that feature (``model_features``), so one stock list serves models
with and without experts; on a model that has the feature a typo'd pattern is still caught.

Tensors matching ``exclude_pattern`` (e.g. witness tensors) are ignored entirely. Bad rules,
missing roots and unreadable dump files raise InputError: bad input, not a verdict.
"""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Sequence, Union

from ftexp.audit.dumps import DumpFile, list_dump_files, load_dump
from ftexp.errors import InputError
from ftexp.verify.predicate import Predicate, parse_predicate
from ftexp.verify.report import CheckResult
from ftexp.verify.tensor_diff import tensor_diff

STATUSES = ("passed", "failed", "failed-allowed", "skipped", "errored")
# Always ignored when matching: the dump's position in the writer's sequence and its file name.
_NEVER_GROUPED = ("dump_index", "filename")

GroupKey = tuple[tuple[str, str], ...]
# (regex, predicate) or (regex, predicate, model feature the rule is for).
RuleSpec = Union[tuple[str, Union[str, Predicate]], tuple[str, Union[str, Predicate], str]]
_FEATURE_RE = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class ThresholdRule:
    pattern: re.Pattern[str]
    predicate: Predicate
    feature: str | None = None  # required to match only on models with this feature

    @property
    def regex(self) -> str:
        return self.pattern.pattern

    def describe(self, index: int) -> str:
        feature = f" (for models with {self.feature})" if self.feature else ""
        return f"threshold rule #{index} {self.regex!r} -> {self.predicate.text!r}{feature}"


def compile_pattern(regex: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except (re.error, TypeError) as e:
        raise InputError(f"{what}: bad regex {regex!r}: {e}") from e


def parse_rules(rules: Sequence[RuleSpec]) -> list[ThresholdRule]:
    """Compile every (regex, predicate[, feature]) rule up front, so a bad rule fails before any file is read."""
    parsed = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) in (2, 3)):
            raise InputError(f"threshold rule #{i} must be a (regex, predicate) pair or a (regex, predicate, "
                             f"model feature) triple, got {rule!r}")
        regex, predicate, feature = (*rule, None) if len(rule) == 2 else rule
        if feature is not None and not (isinstance(feature, str) and _FEATURE_RE.fullmatch(feature)):
            raise InputError(f"threshold rule #{i}: model feature must be a lowercase name such as 'moe', got {feature!r}")
        if not isinstance(predicate, Predicate):
            predicate = parse_predicate(predicate)
        parsed.append(ThresholdRule(compile_pattern(regex, f"threshold rule #{i}"), predicate, feature))
    return parsed


def first_rule(rules: Sequence[ThresholdRule], name: str) -> int | None:
    """Index of the rule that judges ``name``: the first whose regex fully matches it."""
    return next((i for i, r in enumerate(rules) if r.pattern.fullmatch(name)), None)


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
    norm_ratio: float | None = None
    rule: str | None = None  # regex of the rule that judged it
    predicate: str | None = None
    message: str = ""

    def describe(self) -> str:
        coords = ", ".join(f"{k}={v}" for k, v in self.key.items() if k != "name")
        head = f"{self.leaf}: {self.name} [{coords}] {self.status}"
        if self.rel is None:
            return f"{head}: {self.message}"
        return (f"{head}: rel={self.rel:.6g} max_abs={self.max_abs:.6g} mean_abs={self.mean_abs:.6g} "
                f"norm_ratio={self.norm_ratio:.6g} against rule {self.rule!r} -> {self.predicate!r}")


@dataclass
class DumpComparison:
    baseline_root: Path
    target_root: Path
    leaves: list[str]  # leaves present on both sides, i.e. compared
    records: list[DumpRecord] = field(default_factory=list)
    issues: list[str] = field(default_factory=list)
    # Per threshold rule: how many tensors it was the first match of, and whether that is fine.
    rules: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.issues

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(r.status for r in self.records)
        return {status: counted[status] for status in STATUSES}

    def worst(self, n: int, by: str = "rel") -> list[DumpRecord]:
        """The ``n`` compared records with the highest ``by`` (rel or norm_ratio); NaN ranks worst of all."""
        measured = [r for r in self.records if getattr(r, by) is not None]
        return sorted(measured, key=lambda r: math.inf if math.isnan(getattr(r, by)) else getattr(r, by),
                      reverse=True)[:n]

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON; rel/max_abs/mean_abs may be NaN (``report.json_safe`` encodes it)."""
        return {
            "passed": self.passed,
            "baseline_root": str(self.baseline_root),
            "target_root": str(self.target_root),
            "leaves": self.leaves,
            "counts": self.counts,
            "issues": self.issues,
            "rules": self.rules,
            "records": [asdict(r) for r in self.records],
        }

    def to_check(self, name: str = "dumps", worst_n: int = 10) -> CheckResult:
        """A report check: summary counts, the worst tensors and every record that did not pass."""
        counts = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)
        summary = f"{len(self.leaves)} leaves, {counts or 'no tensors'}; {len(self.issues)} issues"
        if self.issues:
            summary += f"; first: {self.issues[0]}"
        details = {
            "kind": "dumps",
            "leaves": self.leaves,
            "counts": self.counts,
            "issues": self.issues,
            "rules": self.rules,
            "worst": [asdict(r) for r in self.worst(worst_n)],
            "worst_norm_ratio": [asdict(r) for r in self.worst(worst_n, by="norm_ratio")],
            "not_passed": [asdict(r) for r in self.records if r.status != "passed"],
        }
        return CheckResult(name, self.passed, summary, details)


def leaf_set(root: str | Path) -> list[str]:
    """Sorted leaf dirs under ``root``: parents of ``**/*.pt``, relative posix paths ("." for root)."""
    root = Path(root)
    return sorted({p.parent.relative_to(root).as_posix() for p in root.rglob("*.pt") if p.is_file()})


def group_leaf(leaf_dir: Path, skip: frozenset[str], exclude: re.Pattern[str] | None) -> dict[GroupKey, list[DumpFile]]:
    """The dump files of one leaf by grouping key (every file-name field but those in ``skip``)."""
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


class _RecentTensors:
    """The tensors of the dump files read last, up to ``max_bytes`` in all, by file identity.

    A verdict reads the baseline's dumps once per rule set and once more per cell compared with them
    (3.6 reads a file on dp4), and reading a small dump file costs more than comparing it. A file
    rewritten since (dumps are replaced by rename) has a new identity, so it is read again.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held_bytes = max_bytes, 0
        self.tensors: OrderedDict[tuple, Any] = OrderedDict()

    def load(self, path: Path):
        try:
            stat = path.stat()
        except OSError:
            return load_dump(path)  # which names the file and the cause in one line
        key = (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if key in self.tensors:
            self.tensors.move_to_end(key)
            return self.tensors[key]
        tensor = load_dump(path)
        size = tensor.untyped_storage().nbytes()
        if size <= self.max_bytes:
            self.tensors[key] = tensor
            self.held_bytes += size
            while self.held_bytes > self.max_bytes:
                self.held_bytes -= self.tensors.popitem(last=False)[1].untyped_storage().nbytes()
        return tensor


_RECENT = _RecentTensors(max_bytes=256 << 20)


def load_tensor(f: DumpFile):
    """One dump's tensor (never modified: it may be served again); a corrupt file is bad input (InputError)."""
    try:
        return _RECENT.load(f.path)
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
        baseline = group_leaf(baseline_dir, self.skip, self.exclude)
        target = group_leaf(target_dir, self.skip, self.exclude)
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
        index = first_rule(self.rules, name)
        rule = self.rules[index] if index is not None else None
        if rule is None:
            return record("errored", True, f"no threshold rule matches {name!r}; add a catch-all '.*'")
        judged_by = {"rule": rule.regex, "predicate": rule.predicate.text}
        try:
            diff = tensor_diff(load_tensor(b_files[0]), load_tensor(t_files[0]))
        except ValueError as e:  # shape mismatch
            return record("errored", True, str(e), **judged_by)
        numbers = diff.as_dict()
        if rule.predicate.evaluate(**numbers):
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
    model_features: Collection[str] = (),
) -> DumpComparison:
    """Compare every tensor of ``<baseline_root>/<phase_subdir>`` with its twin under the target root.

    ``model_features`` names what the run's model has (e.g. ``{"moe", "qk_norm"}``): a rule tagged
    with a feature the model lacks may match nothing; every other rule must judge some tensor.
    """
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
    result.rules = _rule_usage(parsed_rules, result.records, frozenset(model_features))
    if result.records:  # with no tensors at all, that is the issue (reported above), not the rules
        result.issues += [f"{u['rule']} is the first match of no tensor: a dead rule (a typo'd pattern, "
                          f"or one shadowed by an earlier rule)" for u in result.rules if u["status"] == "dead"]
    return result


def _rule_usage(rules: list[ThresholdRule], records: list[DumpRecord], features: frozenset[str]) -> list[dict[str, Any]]:
    """Per rule: the tensors (records, any status) it is the first match of, and live / dead / not applicable."""
    hits = Counter(first_rule(rules, r.name) for r in records)
    usage = []
    for i, rule in enumerate(rules):
        if hits[i]:
            status = "live"
        elif rule.feature is not None and rule.feature not in features:
            status = "not applicable"  # e.g. an expert rule on a dense model
        else:
            status = "dead"
        usage.append({"index": i, "rule": rule.describe(i), "regex": rule.regex, "predicate": rule.predicate.text,
                      "feature": rule.feature, "first_match_of": hits[i], "status": status})
    return usage
