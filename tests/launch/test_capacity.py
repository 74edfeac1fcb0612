"""What a cluster cannot give a mode is refused at launch, every reason in one line."""

import re

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ftexp.cli import register_configs
from ftexp.config import ExperimentConfig
from ftexp.errors import InputError
from ftexp.launch import capacity


def _cfg(*overrides: str) -> ExperimentConfig:
    register_configs()
    with initialize_config_module(config_module="ftexp.conf", version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def test_the_six_node_mode_needs_4_train_and_2_rollout_nodes(monkeypatch):
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: 2)
    with pytest.raises(InputError, match=re.escape("needs 6 nodes, 4 train + 2 rollout (launcher=slurm has 2)")):
        capacity.check_capacity(_cfg("mode=6node_dp4_cp2_tp2_pp2_ep2_etp2", "launcher=slurm"))
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: 6)
    # its 4 cells of 8 ranks fit 4 train nodes, one cell each, its 2 engines of 8 GPUs 2 rollout nodes; expert-TP 2
    # runs on CPU too (``cpu_compat`` pads its unevenly sized collectives for gloo)
    capacity.check_capacity(_cfg("mode=6node_dp4_cp2_tp2_pp2_ep2_etp2", "launcher=slurm"))


def test_live_engines_get_rollout_nodes_of_their_own(monkeypatch):
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: 2)
    capacity.check_capacity(_cfg("mode=dp2_cp2_real_rollout_dense", "launcher=slurm", "launcher.nodes=2"))
    with pytest.raises(InputError, match="needs 3 nodes, 2 train . 1 rollout .launcher=slurm has 2."):
        capacity.check_capacity(_cfg("mode=dp2_cp2_real_rollout_dense", "launcher=slurm", "launcher.nodes=3"))
    with pytest.raises(InputError, match="rollout.backend=sglang engines on rollout nodes"):
        capacity.check_capacity(_cfg("mode=dp2_cp2_real_rollout_dense", "launcher=slurm", "launcher.nodes=2",
                                     "trainer.rollout.backend=sglang"))


def test_cells_that_do_not_fit_the_nodes_are_refused(monkeypatch):
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: 3)
    capacity.check_capacity(_cfg("mode=dp4", "launcher=slurm", "launcher.nodes=2"))
    with pytest.raises(InputError, match="8 ranks do not fit on 2 node.s. of 3 ranks"):
        capacity.check_capacity(_cfg("mode=dp4_cp2", "launcher=slurm", "launcher.nodes=2", "mode.train_cpus_per_node=3"))
    with pytest.raises(InputError, match="do not fit whole on 3 node.s. of 3 ranks .1 cell.s. per node"):
        capacity.check_capacity(_cfg("mode=dp4_cp2", "launcher=slurm", "launcher.nodes=3", "mode.train_cpus_per_node=3"))
    with pytest.raises(InputError, match="needs 4 train nodes .launcher=slurm has 3."):
        capacity.check_capacity(_cfg("mode=dp4", "launcher=slurm", "launcher.nodes=4"))
