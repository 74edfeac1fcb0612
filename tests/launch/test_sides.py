"""The job spec each side's training job receives: where its rollouts come from, what it injects."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ftexp.cli import register_configs
from ftexp.config import ExperimentConfig
from ftexp.launch.sides import job_spec
from ftexp.rundir import BASELINE, TARGET
from ftexp.validate import validate


def _cfg(*overrides: str) -> ExperimentConfig:
    register_configs()
    with initialize_config_module(config_module="ftexp.conf", version_base=None):
        cfg = OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    validate(cfg)
    return cfg


def test_live_rollout_sides_train_on_their_own_rollouts_and_the_target_injects_after_the_heal():
    cfg = _cfg("mode=dp2_cp2_real_rollout_dense", "scenario=with_failure")
    run = Path("/runs/x")
    phase_a, phase_b = cfg.scenario.phases
    baseline, target = job_spec(cfg, run, BASELINE, phase_b), job_spec(cfg, run, TARGET, phase_b)
    assert baseline.data_dir == run / "baseline" / "phase_b" / "rollout_data" and baseline.inject is None
    assert target.data_dir == run / "target" / "phase_b" / "rollout_data"
    assert (target.inject.data_dir, target.inject.start_rollout_id) == (baseline.data_dir, 3)
    assert job_spec(cfg, run, TARGET, phase_a).inject is None  # no heal planned in phase_a


@pytest.mark.parametrize("overrides", [
    ("mode=dp2", "scenario=with_failure"),
    ("mode=dp4", "scenario=node_failure", "launcher=slurm", "launcher.nodes=2"),  # plans need the placement
])
def test_recorded_rollout_sides_share_the_recorded_data_and_inject_nothing(overrides):
    cfg = _cfg(*overrides)
    for phase in cfg.scenario.phases:
        for side in (BASELINE, TARGET):
            spec = job_spec(cfg, Path("/runs/x"), side, phase)
            assert spec.data_dir == Path("/runs/x/rollout_data") and spec.inject is None
