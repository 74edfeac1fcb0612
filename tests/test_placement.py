"""Multi-node placement: whole cells per node, straddling only when a cell outgrows a node, and node faults in the plan."""

import pytest

from ftexp.errors import InputError
from ftexp.faults.plan import FaultPlan, TestAction, TestActionKind
from ftexp.placement import Placement
from ftexp.scenarios.comparison import planned_reconfigures
from ftexp.verify.reconfigure import ReconfigureInfo

KILL, RESTORE = TestActionKind.kill_node_before_allreduce, TestActionKind.restore_node_at_end


def test_cells_fill_nodes_whole_and_evenly_by_default():
    dp4 = Placement.build(num_cells=4, ranks_per_cell=1, nodes=2)
    assert dp4.rank_nodes == ((0,), (0,), (1,), (1,)) and dp4.cells_on(1) == [2, 3]
    dp4_cp2 = Placement.build(num_cells=4, ranks_per_cell=2, nodes=2)
    assert [dp4_cp2.cell_nodes(c) for c in range(4)] == [[0], [0], [1], [1]]
    assert dp4_cp2.baseline_ranks_on(0) == [0, 1, 2, 3] and dp4_cp2.baseline_ranks_on(1) == [4, 5, 6, 7]
    # the seed's 6-node mode: 4 cells of tp2*pp2*cp2 = 8 ranks on its 4 train nodes, one cell per node
    six = Placement.build(num_cells=4, ranks_per_cell=8, nodes=4)
    assert [six.cell_nodes(c) for c in range(4)] == [[0], [1], [2], [3]]


def test_a_cell_straddles_only_when_it_outgrows_a_node():
    three_per_node = Placement.build(num_cells=2, ranks_per_cell=2, nodes=2, ranks_per_node=3)
    assert three_per_node.rank_nodes == ((0, 0), (1, 1))  # never a cell split 0,1 to fill node 0's third slot
    big = Placement.build(num_cells=2, ranks_per_cell=4, nodes=4, ranks_per_node=2)
    assert big.rank_nodes == ((0, 0, 1, 1), (2, 2, 3, 3)) and big.cells_on(1) == [0]
    with pytest.raises(InputError, match="do not fit"):
        Placement.build(num_cells=3, ranks_per_cell=2, nodes=2, ranks_per_node=2)


def test_a_node_fault_takes_every_cell_of_the_node_and_restores_them_together():
    placement = Placement.build(num_cells=4, ranks_per_cell=1, nodes=2)
    plan = FaultPlan([TestAction(at_rollout=1, action=KILL, node_index=1),
                      TestAction(at_rollout=1, action=RESTORE, node_index=1)], 4, placement)
    assert plan.node_fault_before_reduce(cell=2, rank=0, rollout_id=1, attempt=0).cells == (2, 3)
    assert plan.node_fault_before_reduce(cell=3, rank=0, rollout_id=1, attempt=0) is None  # one rank sets it off
    assert planned_reconfigures(plan, [0, 1, 2], 4) == [
        ReconfigureInfo(1, None, [], [0, 1]),          # both cells of node 1 shrink out at once
        ReconfigureInfo(2, 0, [2, 3], [0, 1, 2, 3]),   # and heal together from cell 0
    ]


@pytest.mark.parametrize("node, placement, message", [
    (1, None, "needs a multi-node job"),
    (0, Placement.build(4, 1, 2), "node 0 runs the driver"),
    (2, Placement.build(4, 1, 2), "must name a node 1..1"),
])
def test_node_faults_need_a_node_that_can_be_lost(node, placement, message):
    with pytest.raises(InputError, match=message):
        FaultPlan([TestAction(at_rollout=1, action=KILL, node_index=node)], 4, placement)
