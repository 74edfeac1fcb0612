"""Which rollouts the driver trains in one call (``next_run``): consecutive ones with nothing to run between them.

How a run is trained, committed and retried is ``test_cell_group.py``'s; a crash inside a run, end to end, is
``tests/e2e/test_scenarios.py``'s audit-off with_failure run.
"""

import dataclasses

from ftexp.config import ControlConfig, ModeConfig, NegativeControl, SoakConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan, TestAction, TestActionKind
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.trainer.driver import next_run


def _runs(spec: JobSpec) -> list[list[int]]:
    pending, runs = list(spec.rollout_ids()), []
    while pending:
        runs.append(next_run(spec, pending))
        pending = pending[len(runs[-1]):]
    return runs


def test_a_run_ends_after_a_rollout_that_something_follows(tmp_path):
    stop = TestAction(at_rollout=2, action=TestActionKind.stop_cell_at_end)
    spec = JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path,
                   trainer=TrainerConfig(audit=False, enable_witness=False), mode=ModeConfig(name="dp2", num_cells=2),
                   num_rollout=8, plan=FaultPlan([stop], 2), save_interval=4)
    # rollout 2 has a test action after it, rollouts 3 and 7 a save
    assert _runs(spec) == [[0, 1, 2], [3], [4, 5, 6, 7]]
    assert _runs(dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, rollouts_per_call=2))) == [
        [0, 1], [2], [3], [4, 5], [6, 7]]
    # The audit runs at a run's edges (the analyzer before each call, every rollout's witness ids handed out
    # before the run's first): it leaves the runs as they were.
    assert _runs(dataclasses.replace(spec, trainer=TrainerConfig(enable_witness=True))) == [[0, 1, 2], [3], [4, 5, 6, 7]]
    # The rollout after a stop or a start trains alone: its quorum's first commit reaches the driver at once.
    start = TestAction(at_rollout=1, action=TestActionKind.start_cell_at_end)
    assert _runs(dataclasses.replace(spec, plan=FaultPlan([start], 2))) == [[0, 1], [2], [3], [4, 5, 6, 7]]
    for changed in (dict(trainer=dataclasses.replace(spec.trainer, negative_control=NegativeControl.double_apply_retry)),
                    dict(trainer=dataclasses.replace(spec.trainer, rollouts_per_call=1)),
                    dict(soak=SoakConfig()), dict(control=ControlConfig(enabled=True)),
                    dict(mode=ModeConfig(name="dp2", num_cells=2, rollout_num_engines=1))):
        assert _runs(dataclasses.replace(spec, **changed)) == [[r] for r in range(8)], changed


def test_a_run_hands_out_no_more_witness_ids_than_the_ring_allows_between_two_commits(tmp_path):
    """Ids handed out from one commit to the next may number at most 30 % of the witness ring (more, and a slot
    could come round again before a commit zeroed it); a run hands out all its rollouts' ids before its first."""
    trainer = TrainerConfig(enable_witness=True)
    samples = trainer.rollout.samples
    spec = JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path, trainer=trainer,
                   mode=ModeConfig(name="dp2", num_cells=2), num_rollout=8, plan=FaultPlan([], 2))
    for buffer, runs in ((10 * samples, [[0, 1, 2], [3, 4, 5], [6, 7]]),  # 0.3 * 10 rollouts' ids: three rollouts
                         (3 * samples, [[r] for r in range(8)]),            # below one: still one rollout per call
                         (100 * samples, [list(range(8))])):
        assert _runs(dataclasses.replace(spec, trainer=dataclasses.replace(trainer, witness_buffer_size=buffer))) == runs
