"""Which tensors exist: the inventory of two dump trees, checked apart from their values.

The value comparison (``dumps``) judges the pairs it finds; this asks whether the right tensors
were dumped at all. A side's inventory of one rollout leaf is every tensor's grouping key (name
and parallel coordinates, as ``dumps`` matches them) with its shape and dtype. It must be:

- present: exactly the expected leaves on both sides, none empty, no key twice in a leaf;
- the same on both sides, leaf by leaf: names, coordinates, shapes and dtypes;
- the same in every rollout of a side: a tensor lost from both sides of one rollout passes the
  value comparison, not this;
- paired: every ``grad__X`` has a ``weight__X`` of the same shape at the same coordinates and
  vice versa, so a parameter missing from every dump of both sides still shows.

Fails closed; the first issue names the first differing tensor. Tensors matching
``exclude_pattern`` (witnesses) are left out, as in the value comparison. Unreadable dumps raise
InputError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ftexp.verify.dumps import GroupKey, compile_pattern, group_leaf, leaf_set, load_tensor
from ftexp.verify.report import CheckResult

# Always ignored when matching, as in ``dumps``: the writer's sequence number and the file name.
_NEVER_GROUPED = ("dump_index", "filename")
_PAIRED = ("weight__", "grad__")

Entry = tuple[tuple[int, ...], str]  # (shape, dtype)


def _describe(key: GroupKey) -> str:
    fields = dict(key)
    coords = ", ".join(f"{k}={v}" for k, v in fields.items() if k != "name")
    return f"{fields.get('name', '?')} [{coords}]"


def _entry(entry: Entry) -> str:
    shape, dtype = entry
    return f"{dtype} {list(shape)}"


@dataclass
class LeafInventory:
    tensors: dict[GroupKey, Entry]
    duplicates: list[str]  # keys held by more than one file


def leaf_inventory(leaf_dir: Path, skip: frozenset[str], exclude=None) -> LeafInventory:
    tensors, duplicates = {}, []
    for key, files in sorted(group_leaf(leaf_dir, skip, exclude).items()):
        if len(files) > 1:
            duplicates.append(f"{_describe(key)} held by {len(files)} files: {', '.join(f.path.name for f in files)}")
        value = load_tensor(files[0])
        tensors[key] = (tuple(value.shape), str(value.dtype).removeprefix("torch."))
    return LeafInventory(tensors, duplicates)


def _differences(a: dict[GroupKey, Entry], b: dict[GroupKey, Entry], a_name: str, b_name: str) -> list[str]:
    """Every key present on one side only or with another shape/dtype, in key order."""
    issues = []
    for key in sorted(a.keys() | b.keys()):
        if key not in b:
            issues.append(f"{_describe(key)} in {a_name}, missing in {b_name}")
        elif key not in a:
            issues.append(f"{_describe(key)} in {b_name}, missing in {a_name}")
        elif a[key] != b[key]:
            issues.append(f"{_describe(key)}: {a_name} {_entry(a[key])} vs {b_name} {_entry(b[key])}")
    return issues


def _unpaired(tensors: dict[GroupKey, Entry]) -> list[str]:
    """grad__X without weight__X (same coordinates, same shape) and vice versa."""
    issues = []
    for key, (shape, _) in sorted(tensors.items()):
        fields = dict(key)
        for prefix, twin_prefix in (_PAIRED, _PAIRED[::-1]):
            if fields["name"].startswith(prefix):
                twin = tuple(sorted({**fields, "name": twin_prefix + fields["name"][len(prefix):]}.items()))
                if twin not in tensors:
                    issues.append(f"{_describe(key)} has no {twin_prefix}{fields['name'][len(prefix):]}")
                elif tensors[twin][0] != shape and prefix == _PAIRED[0]:
                    issues.append(f"{_describe(key)} shape {list(shape)} vs its {twin_prefix} {list(tensors[twin][0])}")
    return issues


@dataclass
class InventoryComparison:
    expected_leaves: list[str]
    leaves: dict[str, list[str]] = field(default_factory=dict)  # side -> leaves found
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # side -> leaf -> tensors
    issues: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.issues

    def to_check(self, name: str = "tensor_inventory") -> CheckResult:
        per_leaf = sorted({n for side in self.counts.values() for n in side.values()})
        if self.passed:
            summary = (f"{len(self.expected_leaves)} leaves x {per_leaf[0]} tensors on each side: "
                       f"names, coordinates, shapes and dtypes equal across sides and rollouts, weights and grads paired")
        else:
            summary = f"{len(self.issues)} issue(s); first: {self.issues[0]}"
        details: dict[str, Any] = {"expected_leaves": self.expected_leaves, "leaves": self.leaves,
                                   "tensors_per_leaf": self.counts, "issues": self.issues}
        return CheckResult(name, self.passed, summary, details)


def compare_inventories(
    baseline_root: str | Path,
    target_root: str | Path,
    expected_leaves: Sequence[str],
    *,
    exclude_pattern: str | None = None,
    grouping_skip_keys: Sequence[str] = ("rank", "dp", "edp"),
) -> InventoryComparison:
    """Check which tensors the two dump trees hold (see the module doc); never looks at values."""
    skip = frozenset(_NEVER_GROUPED) | frozenset(grouping_skip_keys)
    exclude = compile_pattern(exclude_pattern, "threshold.exclude_pattern") if exclude_pattern is not None else None
    result = InventoryComparison(list(expected_leaves))
    if not expected_leaves:
        result.issues.append("no leaves expected: nothing would be inventoried")
    sides: dict[str, dict[str, LeafInventory]] = {}
    for side, root in (("baseline", Path(baseline_root)), ("target", Path(target_root))):
        found = leaf_set(root) if root.is_dir() else []
        result.leaves[side] = found
        result.issues += [f"{side}: leaf {leaf} missing" for leaf in expected_leaves if leaf not in found]
        result.issues += [f"{side}: unexpected leaf {leaf}" for leaf in found if leaf not in expected_leaves]
        sides[side] = {leaf: leaf_inventory(root / leaf, skip, exclude) for leaf in expected_leaves if leaf in found}
        result.counts[side] = {leaf: len(inv.tensors) for leaf, inv in sides[side].items()}
        for leaf, inv in sides[side].items():
            if not inv.tensors:
                result.issues.append(f"{side}: leaf {leaf} holds no tensors")
            result.issues += [f"{side} {leaf}: {d}" for d in inv.duplicates]
    for leaf in expected_leaves:  # side against side
        if leaf in sides["baseline"] and leaf in sides["target"]:
            result.issues += [f"{leaf}: {d}" for d in _differences(sides["baseline"][leaf].tensors,
                                                                    sides["target"][leaf].tensors, "baseline", "target")]
    for side, leaves in sides.items():  # rollout against rollout, then weight against grad
        if not leaves:
            continue
        first, *rest = leaves
        for leaf in rest:
            result.issues += [f"{side}: {d}" for d in _differences(leaves[first].tensors, leaves[leaf].tensors, first, leaf)]
        for leaf, inv in leaves.items():
            result.issues += [f"{side} {leaf}: {d}" for d in _unpaired(inv.tensors)]
    return result
