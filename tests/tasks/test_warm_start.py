"""The warm-up once per run, and across runs: who computes it, who loads it, and when a cache entry counts.

A stand-in replica (a counter of supervised steps and one weight it moves) keeps these tests to the
hand-off logic; that the cells of a real run start bitwise equal is the analyzer's checksum rule in the
``realistic`` end-to-end runs.
"""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ftexp.config import Engine, ModeConfig, TaskConfig, TaskName, TrainerConfig, WarmupConfig
from ftexp.faults.plan import FaultPlan, NegativeControl
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.tasks.warmup import cached_warmup, rank_file, warm_start, warmup_key


class StandInReplica:
    def __init__(self):
        self.weight, self.steps = torch.zeros(3), 0

    def supervised_step(self, batch, lr: float) -> float:
        self.steps += 1
        self.weight += lr * batch.tokens.float().mean()
        return float(self.weight.sum())

    def state_dict(self):
        return {"weight": self.weight.clone(), "steps": self.steps}

    def load_state_dict(self, state):
        self.weight = state["weight"].clone()


MODE = ModeConfig(name="m", num_cells=2, model_preset="tiny_dense", engines=[Engine.megatron])
TRAINER = TrainerConfig(engine=Engine.megatron)
TASK = TaskConfig(name=TaskName.arith, warmup=WarmupConfig(steps=3, batch_size=4))


def _spec(tmp_path: Path, task: TaskConfig = TASK, cached: Path | None = None) -> JobSpec:
    return JobSpec(side="target", phase="", side_dir=SideDir(tmp_path / "target"), data_dir=tmp_path / "data",
                   trainer=TRAINER, mode=MODE, num_rollout=1, plan=FaultPlan([], 2, None), task=task,
                   warmup_cached=cached)


def test_the_first_cell_warms_up_and_the_others_load_its_state(tmp_path):
    spec = _spec(tmp_path)
    first, second = StandInReplica(), StandInReplica()
    warm_start(first, spec, cell_index=0, rank_within_cell=0)
    warm_start(second, spec, cell_index=1, rank_within_cell=0)
    assert first.steps == 3 and second.steps == 0
    assert torch.equal(first.weight, second.weight) and first.weight.abs().sum() > 0
    assert (spec.side_dir.warmup / rank_file(0)).is_file()


def test_a_cache_entry_is_complete_with_every_ranks_state_and_then_replaces_the_warm_up(tmp_path):
    cache = tmp_path / "cache"
    task = replace(TASK, warmup=replace(TASK.warmup, cache_dir=str(cache)))
    key = warmup_key(MODE, TRAINER, task, 1, False)
    spec = _spec(tmp_path / "run1", task)
    assert cached_warmup(str(cache), key, ranks_per_cell=2) is None
    warm_start(StandInReplica(), spec, cell_index=0, rank_within_cell=0)
    assert cached_warmup(str(cache), key, ranks_per_cell=2) is None  # rank 1's state is still missing
    computed = StandInReplica()
    warm_start(computed, spec, cell_index=0, rank_within_cell=1)
    entry = cached_warmup(str(cache), key, ranks_per_cell=2)
    assert entry == cache / key

    # A later run with the same settings: every cell, the first included, loads instead of warming up.
    loaded = StandInReplica()
    warm_start(loaded, _spec(tmp_path / "run2", task, cached=entry), cell_index=0, rank_within_cell=1)
    assert loaded.steps == 0 and torch.equal(loaded.weight, computed.weight)
    assert not (tmp_path / "run2" / "target" / "warmup").exists()


def test_the_key_follows_what_the_state_depends_on_and_nothing_else():
    key = warmup_key(MODE, TRAINER, TASK, 1, False)
    same = [
        warmup_key(MODE, replace(TRAINER, negative_control=NegativeControl.skip_engine_update_after_heal, audit=False,
                                 spare_cells=1, cross_cell_timeout_s=3.0), TASK, 1, False),
        warmup_key(MODE, TRAINER, replace(TASK, warmup=replace(TASK.warmup, cache_dir="/elsewhere")), 1, False),
    ]
    assert same == [key, key]
    other = [
        warmup_key(MODE, TRAINER, TASK, 2, False),
        warmup_key(MODE, TRAINER, TASK, 1, True),
        warmup_key(replace(MODE, cp=2), TRAINER, TASK, 1, False),
        warmup_key(MODE, replace(TRAINER, lr=3e-4), TASK, 1, False),
        warmup_key(MODE, TRAINER, replace(TASK, warmup=replace(TASK.warmup, steps=4)), 1, False),
        warmup_key(MODE, TRAINER, replace(TASK, digits=2), 1, False),
    ]
    assert key not in other and len(set(other)) == len(other)


def test_a_waiting_cell_gives_up_with_the_path_it_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr("ftexp.tasks.warmup.HANDOFF_DEADLINE_S", 0.2)
    with pytest.raises(TimeoutError, match=str(tmp_path / "target" / "warmup" / rank_file(0))):
        warm_start(StandInReplica(), _spec(tmp_path), cell_index=1, rank_within_cell=0)
