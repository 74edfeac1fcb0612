"""Every alive cell's own dumps against the baseline, not only the cell that writes the group's.

The first alive cell of a commit writes the group's dumps (``<target>/dumps``), which the main dump
checks compare. Every other cell writes the same tensors under its own root
(``rundir.SideDir.cell_dumps``) at its first commit in a new quorum — a phase's first rollout, and
every rollout the group reconfigures at: a healed cell's gradients and weights, or a survivor's after
a shrink, are then compared with the baseline's tensor by tensor too, with the same rules, and not
only through the hashes of the cross-replica checksum rule. While the quorum stays the same, that
rule holds every cell's weights and optimizer state bitwise equal to the first cell's after each
commit, so more dumps would add the writes (every cell's full state, every rollout) and not a check.

Which leaves each cell's root must hold is derived from the plan: a missing or an extra leaf fails
the check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Collection

from ftexp.config import ThresholdConfig
from ftexp.rundir import SideDir, dump_leaf_name
from ftexp.verify.dumps import DumpComparison, compare_dumps, leaf_set
from ftexp.verify.report import CheckResult


def other_cells(committers: dict[int, list[int]], new_quorums: Collection[int]) -> dict[int, list[int]]:
    """cell -> the rollouts it dumps to its own root: those of ``new_quorums`` (committed in a quorum that
    the rollout before did not commit in) that it commits while another cell is the first alive."""
    per_cell: dict[int, list[int]] = {}
    for rollout_id, cells in sorted(committers.items()):
        if rollout_id not in new_quorums:
            continue
        for cell in cells[1:]:
            per_cell.setdefault(cell, []).append(rollout_id)
    return per_cell


def _compare_leaves(baseline_dumps: Path, cell_root: Path, leaves: list[str], rules: list[tuple], *,
                    features: Collection[str], th: ThresholdConfig) -> DumpComparison:
    """``compare_dumps`` leaf by leaf (the cell holds a subset of the baseline's leaves), merged into one."""
    merged = DumpComparison(baseline_dumps, cell_root, [])
    usage: dict[int, dict] = {}
    for leaf in leaves:
        one = compare_dumps(baseline_dumps, cell_root, rules, phase_subdir=leaf, model_features=features,
                            exclude_pattern=th.exclude_pattern, allow_skipped_pattern=th.allow_skipped_pattern,
                            allow_failed_pattern=th.allow_failed_pattern)
        described = {r.describe() for r in one.records if r.failure}
        for record in one.records:
            record.leaf = leaf  # compared as the root of a one-leaf tree: name the leaf it is
        merged.leaves.append(leaf)
        merged.records += one.records
        merged.issues += [r.describe() for r in one.records if r.failure]
        # The rest: a dead rule (the same in every leaf: named once) or nothing dumped at all.
        merged.issues += [i if i.startswith("threshold rule") else f"{leaf}: {i}" for i in one.issues
                          if i not in described and i not in merged.issues]
        for rule in one.rules:
            seen = usage.setdefault(rule["index"], {**rule, "first_match_of": 0})
            seen["first_match_of"] += rule["first_match_of"]
            if rule["status"] == "live":
                seen["status"] = "live"
    merged.rules = [usage[i] for i in sorted(usage)]
    return merged


def check_cell_dumps(baseline_dumps: Path, target: SideDir, committers: dict[int, list[int]],
                     new_quorums: Collection[int], num_cells: int, th: ThresholdConfig, *, features: Collection[str],
                     label: str) -> list[CheckResult]:
    """Per cell that commits as a non-first cell in a new quorum, or dumped anyway: its leaves exactly as
    planned, every tensor within the rules."""
    checks = []
    planned = other_cells(committers, new_quorums)
    found = [cell for cell in range(num_cells) if target.cell_dumps(cell).exists()]
    for cell in sorted(set(planned) | set(found)):
        root = target.cell_dumps(cell)
        expected = [dump_leaf_name(r) for r in planned.get(cell, [])]
        actual = leaf_set(root) if root.is_dir() else []
        leaves_ok = sorted(actual) == sorted(expected)
        checks.append(CheckResult(f"{label}cell_dump_leaves/cell{cell}", leaves_ok,
                                  f"leaves {actual}" + ("" if leaves_ok else f", expected {expected}"),
                                  {"expected": expected, "actual": actual}))
        # A leaf the baseline lacks fails its own dump_leaves check; compared here are those on both sides.
        compared = [leaf for leaf in expected if leaf in actual and (baseline_dumps / leaf).is_dir()]
        if not compared:
            continue
        for rules, what in ((th.dumps, "dumps"), (th.fp32_dumps, "dumps_fp32")):
            if rules:
                result = _compare_leaves(baseline_dumps, root, compared, [tuple(r) for r in rules], features=features, th=th)
                checks.append(result.to_check(f"{label}{what}/cell{cell}"))
    return checks
