"""What a comparison scenario expects, derived from its fault plan alone: the crashed cell may be any."""

import pytest

from ftexp.config import ModeConfig, PhaseConfig, ScenarioConfig
from ftexp.errors import InputError
from ftexp.faults.plan import TestAction, TestActionKind
from ftexp.scenarios import load_scenario, scenario_modules
from ftexp.scenarios.comparison import expect
from ftexp.verify.reconfigure import ReconfigureInfo

CRASH, STOP, START = TestActionKind.crash_before_allreduce, TestActionKind.stop_cell_at_end, TestActionKind.start_cell_at_end


class Cfg:
    """The two groups ``expect`` reads."""

    def __init__(self, num_cells: int, phases: list[PhaseConfig], num_rollout: int = 4, module: str = "with_failure"):
        self.mode = ModeConfig(name=f"dp{num_cells}", num_cells=num_cells)
        self.scenario = ScenarioConfig(name="s", module=module, num_rollout=num_rollout, phases=phases)


def with_failure(num_cells: int, cell_index: int) -> Cfg:
    actions = [TestAction(at_rollout=2, action=kind, cell_index=cell_index) for kind in (CRASH, STOP, START)]
    return Cfg(num_cells, [PhaseConfig(name="phase_a", save_interval=1, exit_after_rollouts=1),
                           PhaseConfig(name="phase_b", load_from="phase_a", target_actions=actions)])


@pytest.mark.parametrize("num_cells, cell_index, crashed, source", [
    (2, -1, 1, 0), (2, 0, 0, 1), (2, 1, 1, 0),
    (4, -1, 3, 0), (4, 0, 0, 1), (4, 1, 1, 0),
])
def test_with_failure_names_the_planned_cell(num_cells, cell_index, crashed, source):
    cfg = with_failure(num_cells, cell_index)
    phase_a, phase_b = cfg.scenario.phases
    assert expect(cfg, phase_a).target_reconfigures == [] and expect(cfg, phase_a).rollouts == [0]
    expected = expect(cfg, phase_b)
    survivors = [c for c in range(num_cells) if c != crashed]
    assert expected.rollouts == [1, 2, 3] and expected.faults_injected == 1
    assert expected.target_reconfigures == [
        ReconfigureInfo(2, None, [], survivors),
        ReconfigureInfo(3, source, [crashed], list(range(num_cells))),
    ]
    assert expected.baseline_reconfigures == []


def test_deterministic_sees_its_own_heal_and_the_restored_one():
    def stop_start(rollout):
        return [TestAction(at_rollout=rollout, action=STOP, cell_index=0),
                TestAction(at_rollout=rollout, action=START, cell_index=0)]
    cfg = Cfg(2, [PhaseConfig(name="phase_a", save_interval=3, exit_after_rollouts=3, target_actions=stop_start(1)),
                  PhaseConfig(name="phase_b", load_from="phase_a", save_interval=3, exit_after_rollouts=3,
                              target_actions=stop_start(4))], num_rollout=6)
    phase_a, phase_b = cfg.scenario.phases
    assert expect(cfg, phase_a).target_reconfigures == [ReconfigureInfo(2, 1, [0], [0, 1])]
    assert expect(cfg, phase_b).target_reconfigures == [ReconfigureInfo(2, 1, [0], [0, 1]),
                                                        ReconfigureInfo(5, 1, [0], [0, 1])]


def test_a_stop_without_restart_is_a_shrink():
    cfg = Cfg(3, [PhaseConfig(target_actions=[TestAction(at_rollout=0, action=STOP, cell_index=1)])], num_rollout=3)
    assert expect(cfg, cfg.scenario.phases[0]).target_reconfigures == [ReconfigureInfo(1, None, [], [0, 2])]


def test_scenario_modules_declare_kinds_and_refuse_plans_that_prove_nothing():
    assert {"no_failure", "with_failure", "deterministic", "ft_random"} <= set(scenario_modules())
    assert load_scenario(ScenarioConfig(name="x", module="ft_random", num_rollout=1)).is_soak
    assert load_scenario(ScenarioConfig(name="x", module="with_failure", num_rollout=1)).sides == ("baseline", "target")
    with pytest.raises(InputError, match="unknown scenario module 'nope'"):
        load_scenario(ScenarioConfig(name="x", module="nope", num_rollout=1))
    no_crash = Cfg(2, [PhaseConfig(target_actions=[TestAction(at_rollout=0, action=STOP, cell_index=0)])])
    with pytest.raises(InputError, match="needs a crash_before_allreduce"):
        load_scenario(no_crash.scenario).check_plan(no_crash)
    unhealed = Cfg(2, [PhaseConfig(target_actions=[TestAction(at_rollout=0, action=CRASH, cell_index=0)])])
    with pytest.raises(InputError, match=r"crashed cell\(s\) \[0\] are never started again"):
        load_scenario(unhealed.scenario).check_plan(unhealed)


def test_with_the_audit_off_the_event_rules_say_they_did_not_run(tmp_path):
    from ftexp.scenarios.checks import check_event_rules

    check = check_event_rules(tmp_path / "no_events", "target_event_analyzer", audit=False)
    assert check.passed and check.summary.startswith("NOT RUN: trainer.audit=false")
    assert check.details["not_run"] == ["cross_replica_weight_checksum", "witness"]
    assert not check_event_rules(tmp_path / "no_events", "target_event_analyzer").passed  # audit on: fails closed


def test_every_committing_cell_but_the_first_dumps_to_its_own_root_in_each_new_quorum():
    """Cell 0 crashes at 2 (cell 1 writes the group's dumps), a middle cell at 4: each survivor of a shrink, and
    each cell at a heal, must hold exactly the rollouts it committed as a non-first cell in a new quorum. Rollout 6
    commits in 5's quorum and adds none; cell 2, stopped and started after 6, is healed at 7 with the same cells
    committing as at 6, yet in a new quorum."""
    from ftexp.scenarios.cell_dumps import other_cells

    def crash(rollout, cell):
        return [TestAction(at_rollout=rollout, action=kind, cell_index=cell) for kind in (CRASH, STOP, START)]

    def restart(rollout, cell):
        return [TestAction(at_rollout=rollout, action=kind, cell_index=cell) for kind in (STOP, START)]
    cfg = Cfg(4, [PhaseConfig(name="phase_a", save_interval=1, exit_after_rollouts=1),
                  PhaseConfig(name="phase_b", load_from="phase_a", target_actions=crash(2, 0) + crash(4, 1) + restart(6, 2))],
              num_rollout=8)
    expected = expect(cfg, cfg.scenario.phases[1])
    assert expected.committers == {1: [0, 1, 2, 3], 2: [1, 2, 3], 3: [0, 1, 2, 3], 4: [0, 2, 3], 5: [0, 1, 2, 3],
                                   6: [0, 1, 2, 3], 7: [0, 1, 2, 3]}
    assert expected.new_quorums == [1, 2, 3, 4, 5, 7]
    assert other_cells(expected.committers, expected.new_quorums) == {1: [1, 3, 5, 7], 2: [1, 2, 3, 4, 5, 7],
                                                                      3: [1, 2, 3, 4, 5, 7]}
    assert expected.target_reconfigures == [ReconfigureInfo(2, None, [], [1, 2, 3]), ReconfigureInfo(3, 1, [0], [0, 1, 2, 3]),
                                            ReconfigureInfo(4, None, [], [0, 2, 3]), ReconfigureInfo(5, 0, [1], [0, 1, 2, 3]),
                                            ReconfigureInfo(7, 0, [2], [0, 1, 2, 3])]
