"""Multi-node placement: whole cells per node, straddling only when a cell outgrows a node, and node faults in the plan."""

import pytest

from ftexp.errors import InputError
from ftexp.faults.plan import FaultPlan, TestAction, TestActionKind
from ftexp.placement import Placement, job_nodes, placement_for, rollout_node_layout
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


def _cfg(*overrides: str):
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from ftexp.cli import register_configs

    register_configs()
    with initialize_config_module(config_module="ftexp.conf", version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def _assert_engines_off_train_nodes(placement) -> None:
    train = {n for ranks in placement.rank_nodes for n in ranks}
    assert placement.engine_nodes and not train & set(placement.engine_nodes), placement
    assert train == set(range(placement.train_nodes)) and set(placement.engine_nodes) <= set(placement.rollout_nodes)


@pytest.mark.parametrize("overrides, nodes, cells, engines", [
    # launcher.nodes counts every node: 1 train node (both cells) + 1 rollout node (both engines)
    (["mode=dp2_cp2_real_rollout_dense", "launcher.nodes=2", "mode.rollout_num_engines=2"], 2, [[0], [0]], (1, 1)),
    # 4 one-GPU engines fill one 4-GPU rollout node; a third node goes to the cells
    (["mode=dp2_cp2_real_rollout_dense", "launcher.nodes=3"], 3, [[0], [1]], (2, 2, 2, 2)),
    # the seed's 6-node mode: 4 train nodes, one 8-GPU engine on each of 2 rollout nodes
    (["mode=6node_dp4_cp2_tp2_pp2_ep2_etp2"], 6, [[0], [1], [2], [3]], (4, 5)),
])
def test_rollout_engines_get_nodes_of_their_own_after_the_train_nodes(overrides, nodes, cells, engines):
    placement = placement_for(_cfg("launcher=slurm", *overrides))
    assert placement.nodes == nodes and job_nodes(_cfg("launcher=slurm", *overrides)) == nodes
    assert [placement.cell_nodes(c) for c in range(len(cells))] == cells
    assert placement.engine_nodes == engines
    _assert_engines_off_train_nodes(placement)
    assert all(placement.baseline_ranks_on(n) == [] for n in placement.rollout_nodes)  # no baseline rank there either


def test_engines_fill_rollout_nodes_whole():
    assert rollout_node_layout(4, 1, 4) == ((0, 0, 0, 0), 1)
    assert rollout_node_layout(5, 2, 4) == ((0, 0, 1, 1, 2), 3)   # 2 engines per 4-GPU node
    assert rollout_node_layout(2, 16, 8) == ((0, 2), 4)           # an engine larger than a node spans 2
    assert rollout_node_layout(3, 0, 0) == ((0, 0, 0), 1)         # no GPUs named: one rollout node
    two = Placement.build(num_cells=2, ranks_per_cell=1, nodes=2).with_engines(5, 2, 4)
    assert two.nodes == 5 and two.train_nodes == 2 and two.rollout_nodes == [2, 3, 4] and two.engines_on(3) == [2, 3]
    _assert_engines_off_train_nodes(two)


def test_one_node_jobs_keep_their_engines_beside_the_trainer_and_a_rollout_node_holds_no_cell_to_fault():
    assert placement_for(_cfg("mode=dp2_cp2_real_rollout_dense", "launcher=slurm")) is None
    placement = placement_for(_cfg("mode=dp2_cp2_real_rollout_dense", "launcher=slurm", "launcher.nodes=2"))
    with pytest.raises(InputError, match="node 1 holds no cell"):
        FaultPlan([TestAction(at_rollout=1, action=KILL, node_index=1)], 2, placement)


def test_the_placement_check_fails_an_engine_on_a_train_node_or_one_never_placed(tmp_path):
    from ftexp.audit.events import CellPlacementEvent, EnginePlacementEvent, EventLogger, ProcessIdentity
    from ftexp.scenarios.checks import check_placement

    placement = Placement.build(num_cells=2, ranks_per_cell=1, nodes=1).with_engines(2, 1, 4)

    def check(engine_nodes: list[int]):
        events = tmp_path / f"events_{'_'.join(map(str, engine_nodes))}"
        log = EventLogger(events, ProcessIdentity(component="main"))
        for cell in (0, 1):
            log.log(CellPlacementEvent(cell_index=cell, incarnation=1, rank_nodes=[0], planned_rank_nodes=[0]))
        for index, node in enumerate(engine_nodes):
            log.log(EnginePlacementEvent(engine_index=index, node=node, planned_node=1, url="http://127.0.0.1:1"))
        return check_placement(events, placement, "placement")

    planned, on_train_node, unplaced = check([1, 1]), check([1, 0]), check([1])
    assert planned.passed and "node 0: cells [0, 1], node 1: engines [0, 1]" in planned.summary
    assert not on_train_node.passed and "engine 1 on node 0, planned 1" in on_train_node.summary
    assert not unplaced.passed and "no placement event for engines [1]" in unplaced.summary
