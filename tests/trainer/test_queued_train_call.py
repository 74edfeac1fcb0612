"""A train call queued behind a rollout its rank did not commit trains nothing (real CellRank, torch engine).

The driver may queue rollout r+1's call on every rank before it has seen rollout r commit
(``TrainGroup.train(r, queue_next=r + 1)``). The rank is what keeps such a call from stepping on a
state that missed rollout r: it answers "discarded" at once, before it reads anything.
"""

import pytest
import ray

from ftexp.config import Engine, ModeConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.trainer.cell import IndepDPInfo
from ftexp.trainer.cell_rank import DISCARDED, CellRank
from ftexp.trainer.driver import start_local_ray
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
