"""Queued train calls: which rollouts the driver queues, and what a rank does with one it should not train.

The driver may queue rollout r+1's call on every rank before it has seen rollout r commit
(``TrainGroup.train(r, queue_next=r + 1)``), only where nothing has to run between the two. The rank
is what keeps such a call from stepping on a state that missed rollout r: it answers "discarded" at
once, before it reads anything (real CellRank, torch engine).
"""

import dataclasses

import pytest
import ray

from ftexp.config import ControlConfig, Engine, ModeConfig, NegativeControl, SoakConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan, TestAction, TestActionKind
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.trainer.cell import IndepDPInfo
from ftexp.trainer.cell_rank import DISCARDED, CellRank
from ftexp.trainer.driver import next_to_queue
from ftexp.trainer.local_ray import start_local_ray
from ftexp.store import LoopbackStore


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_a_call_queued_behind_an_uncommitted_rollout_is_discarded_untouched(tmp_path):
    # No rollout files: a call that trained would fail reading rollout 3.
    spec = JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path / "no_rollouts",
                   trainer=TrainerConfig(engine=Engine.torch, enable_witness=False, audit=False),
                   mode=ModeConfig(name="dp1", num_cells=1), num_rollout=4, plan=FaultPlan([], 1))
    store = LoopbackStore()
    rank = CellRank.remote(spec, 0, 0, store.address, 1)
    assert ray.get(rank.init.remote(IndepDPInfo.for_cell(0, 1, 0, [0]), None, None), timeout=120)["ok"]
    assert ray.get(rank.train.remote(3, 0, None, queued_after=2), timeout=60) == (DISCARDED, None)
    assert not (tmp_path / "step_sections.jsonl").exists()
    with pytest.raises(ray.exceptions.RayTaskError, match="rollout file not found"):  # unqueued, it does train
        ray.get(rank.train.remote(3, 0, None), timeout=60)
    ray.kill(rank, no_restart=True)


def test_the_driver_queues_a_rollout_only_where_nothing_runs_before_it(tmp_path):
    stop = TestAction(at_rollout=2, action=TestActionKind.stop_cell_at_end)
    spec = JobSpec(side="target", phase="", side_dir=SideDir(tmp_path), data_dir=tmp_path,
                   trainer=TrainerConfig(audit=False, enable_witness=False), mode=ModeConfig(name="dp2", num_cells=2),
                   num_rollout=6, plan=FaultPlan([stop], 2), save_interval=4)
    # rollout 2 has a test action after it, rollout 3 a save, rollout 5 is the last
    assert [next_to_queue(spec, r) for r in range(6)] == [1, 2, None, None, 5, None]
    for changed in (dict(trainer=TrainerConfig()),  # audit on: the analyzer and witness ids run between rollouts
                    dict(trainer=dataclasses.replace(spec.trainer, negative_control=NegativeControl.double_apply_retry)),
                    dict(soak=SoakConfig()), dict(control=ControlConfig(enabled=True)),
                    dict(mode=ModeConfig(name="dp2", num_cells=2, rollout_num_engines=1))):
        assert next_to_queue(dataclasses.replace(spec, **changed), 0) is None, changed
