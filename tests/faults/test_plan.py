"""The fault plan resolves cell indices once and answers the cell rank's and the driver's questions."""

import pytest

from ftexp.faults.plan import FaultPlan, TestAction, TestActionKind, resolve_cell

CRASH, STOP, START = TestActionKind.crash_before_allreduce, TestActionKind.stop_cell_at_end, TestActionKind.start_cell_at_end


def test_resolve_cell_counts_negative_indices_from_the_end():
    assert resolve_cell(-1, 4) == 3 and resolve_cell(-4, 4) == 0 and resolve_cell(2, 4) == 2
    for bad in (4, -5):
        with pytest.raises(ValueError, match="outside the 4 cells"):
            resolve_cell(bad, 4)


def test_plan_answers_who_crashes_and_what_the_driver_does():
    plan = FaultPlan([TestAction(at_rollout=2, action=CRASH, cell_index=-1, rank=1, attempt=0),
                      TestAction(at_rollout=2, action=STOP, cell_index=-1),
                      TestAction(at_rollout=2, action=START, cell_index=-1)], num_cells=3)
    assert plan.crash_before_reduce(cell=2, rank=1, rollout_id=2, attempt=0) is not None
    for other in [(2, 0, 2, 0), (1, 1, 2, 0), (2, 1, 3, 0), (2, 1, 2, 1)]:
        assert plan.crash_before_reduce(*other) is None
    assert [(a.action, a.cell) for a in plan.group_actions_after(2)] == [(STOP, 2), (START, 2)]
    assert plan.group_actions_after(1) == []
