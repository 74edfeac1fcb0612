"""The scripted fault plan of a phase: which cell fails (or is stopped and started) and when.

A scenario's yaml lists ``target_actions``; everyone who acts on them or checks them asks the
plan instead of reading the list: the cell rank ("do I crash before the reduce of rollout k,
attempt a?"), the driver ("which cells do I stop or start after rollout k?") and the scenario's
expectations ("which shrinks and heals must the event log show?"). ``cell_index`` -1 means the
last cell; it is resolved in one place, :func:`resolve_cell`.

Node faults (multi-node jobs) take a whole node away: ``kill_node_before_allreduce`` makes the first
rank placed on ``node_index`` have its node killed right before that rank's cross-cell reduce (so
every cell on the node is lost in the same attempt, before any survivor could commit with it), and
``restore_node_at_end`` brings the node back after the rollout commits; its cells are then healed.
Which cells a node holds comes from the job's placement (``ftexp.placement``), given to the plan.

Negative controls are deliberate healing and retry bugs, planted to prove the verdict turns red.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ftexp.errors import InputError
from ftexp.missing import MISSING


class TestActionKind(enum.Enum):
    __test__ = False  # not a pytest class
    crash_before_allreduce = "crash_before_allreduce"  # actor-level: exit hard before the reduce
    stop_cell_at_end = "stop_cell_at_end"              # group-level, after the rollout commits
    start_cell_at_end = "start_cell_at_end"
    kill_node_before_allreduce = "kill_node_before_allreduce"  # the whole node (all its cells) dies
    restore_node_at_end = "restore_node_at_end"                # group-level: the node comes back, its cells heal


@dataclass
class TestAction:
    """One planned fault. ``cell_index`` -1 means the last cell."""

    __test__ = False  # not a pytest class
    at_rollout: int = MISSING
    action: TestActionKind = MISSING
    cell_index: int = -1
    rank: int = 0
    attempt: int = 0
    node_index: Optional[int] = None  # node faults: which node (never 0, the head)
    # kill_node_before_allreduce: "ray" kills the node's Ray processes (its Slurm task lives on and brings a
    # fresh Ray node back); "slurm" sets the Slurm node down (scontrol): Slurm ends the job's task there, the
    # job goes on without it (--no-kill), and the restore is a replacement node — a new one-node job.
    how: str = "ray"


NODE_ACTIONS = ("kill_node_before_allreduce", "restore_node_at_end")
NODE_FAULT_KINDS = ("ray", "slurm")


class NegativeControl(enum.Enum):
    """Deliberate healing, resume and retry bugs, for tests proving the verdict turns red. Never on by default."""

    skip_heal_transfer = "skip_heal_transfer"          # healed cell keeps its fresh initial state
    skip_optimizer_transfer = "skip_optimizer_transfer"  # healed cell gets weights but no optimizer state
    # Every cell commits attempt 0 but reports it discarded, so the retry trains the samples twice.
    double_apply_retry = "double_apply_retry"
    # A rank whose cross-cell reduce failed steps on its local gradient anyway.
    leak_discarded_attempt = "leak_discarded_attempt"
    # Healed cell gets weights and optimizer state but keeps its own fresh RNG generators.
    skip_rng_transfer = "skip_rng_transfer"
    # A resumed job starts a fresh event log instead of the checkpoint's snapshot (the witness
    # counter restarts and the earlier phase's commits vanish from the audit trail).
    skip_event_restore = "skip_event_restore"
    # Cell 0 writes the group's dumps and metrics instead of the first alive cell: the same while only
    # the last cell ever drops out, nothing at all for the rollouts that cell 0 is down.
    cell0_writes_group_logs = "cell0_writes_group_logs"
    # The cross-cell reduce folds ((c0 + c1) + c2) + c3 instead of the baseline's pairwise tree:
    # bitwise the same on 2 cells (a + b == b + a), not on 4.
    ascending_cell_fold = "ascending_cell_fold"
    # Live rollout engines. From the first heal on the trainer pushes nothing (the engines keep
    # generating from stale weights) ...
    skip_engine_update_after_heal = "skip_engine_update_after_heal"
    # ... or leaves the last engine out of its weight-update group (it keeps an older policy) ...
    stale_engine_after_heal = "stale_engine_after_heal"
    # ... or sends one square tensor transposed (a broken megatron -> HF conversion).
    transposed_weight_conversion = "transposed_weight_conversion"


def resolve_cell(index: int, num_cells: int) -> int:
    """A plan's cell index as a real one: negative counts from the end (-1 = the last cell)."""
    resolved = index + num_cells if index < 0 else index
    if not 0 <= resolved < num_cells:
        raise ValueError(f"cell_index {index} is outside the {num_cells} cells")
    return resolved


@dataclass(frozen=True)
class PlannedAction:
    """A test action with its cell resolved."""

    at_rollout: int
    action: TestActionKind
    cell: int
    rank: int
    attempt: int
    node: int | None = None
    cells: tuple[int, ...] = ()  # node faults: every cell on the node
    how: str = "ray"             # node faults: see TestAction.how


def _resolve(a: TestAction, num_cells: int, placement) -> PlannedAction:
    if a.action.value not in NODE_ACTIONS:
        return PlannedAction(a.at_rollout, a.action, resolve_cell(a.cell_index, num_cells), a.rank, a.attempt)
    if placement is None or not placement.multi_node:
        raise InputError(f"{a.action.value} needs a multi-node job (launcher.nodes > 1)")
    if a.node_index is None or not 1 <= a.node_index < placement.nodes:
        raise InputError(f"{a.action.value}: node_index {a.node_index} must name a node 1..{placement.nodes - 1} "
                         f"(node 0 runs the driver)")
    cells = tuple(placement.cells_on(a.node_index))
    if not cells:
        raise InputError(f"{a.action.value}: node {a.node_index} holds no cell")
    if a.how not in NODE_FAULT_KINDS:
        raise InputError(f"{a.action.value}: how={a.how!r} is not one of {', '.join(NODE_FAULT_KINDS)}")
    cell, rank = placement.first_rank_on(a.node_index)
    return PlannedAction(a.at_rollout, a.action, cell, rank, a.attempt, a.node_index, cells, a.how)


class FaultPlan:
    """The test actions of one phase of one side, with every cell index (and node) resolved.

    ``placement`` (a ``ftexp.placement.Placement``) is needed only by node faults.
    """

    def __init__(self, actions: list[TestAction], num_cells: int, placement=None):
        self.actions = [_resolve(a, num_cells, placement) for a in actions]

    def crash_before_reduce(self, cell: int, rank: int, rollout_id: int, attempt: int) -> PlannedAction | None:
        """The crash planned for this rank of this cell right before this attempt's cross-cell reduce."""
        return next((a for a in self.actions if a.action == TestActionKind.crash_before_allreduce
                     and (a.cell, a.rank, a.at_rollout, a.attempt) == (cell, rank, rollout_id, attempt)), None)

    def node_fault_before_reduce(self, cell: int, rank: int, rollout_id: int, attempt: int) -> PlannedAction | None:
        """The node fault this rank (the first on its node) sets off right before this attempt's reduce."""
        return next((a for a in self.actions if a.action == TestActionKind.kill_node_before_allreduce
                     and (a.cell, a.rank, a.at_rollout, a.attempt) == (cell, rank, rollout_id, attempt)), None)

    def group_actions_after(self, rollout_id: int) -> list[PlannedAction]:
        """Cells to stop or start (nodes to restore) once ``rollout_id`` has committed, in plan order."""
        return [a for a in self.actions if a.at_rollout == rollout_id
                and a.action in (TestActionKind.stop_cell_at_end, TestActionKind.start_cell_at_end,
                                 TestActionKind.restore_node_at_end)]

    def of_kind(self, kind: TestActionKind) -> list[PlannedAction]:
        return [a for a in self.actions if a.action == kind]

    def first_heal_rollout(self) -> int | None:
        """The rollout whose refresh heals the first cell started again (the one after its start action)."""
        starts = self.of_kind(TestActionKind.start_cell_at_end)
        return min(a.at_rollout for a in starts) + 1 if starts else None
