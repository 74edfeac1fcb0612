"""What a cluster cannot give a mode is refused at launch, every reason in one line."""

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from ftexp.config import ExperimentConfig, register_configs
from ftexp.errors import InputError
from ftexp.launch import capacity


def _cfg(*overrides: str) -> ExperimentConfig:
    register_configs()
    with initialize_config_module(config_module="ftexp.conf", version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.parametrize("nodes, message", [
    (2, "needs 4 train nodes (launcher=slurm has 2); and 2 rollout engines on 2 rollout nodes"),
    (6, "needs 2 rollout engines on 2 rollout nodes (live engines run beside the trainer on one node; placing them "
        "on nodes of their own is not built yet); and expert-TP 2"),
])
def test_the_six_node_mode_names_every_remaining_reason(monkeypatch, nodes, message):
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: nodes)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        capacity.check_capacity(_cfg("mode=6node_dp4_cp2_tp2_pp2_ep2_etp2", "launcher=slurm"))
    if nodes >= 4:  # without rollout engines and expert-TP its 4 cells of 8 ranks fit 4 nodes, one cell each
        capacity.check_capacity(_cfg("mode=6node_dp4_cp2_tp2_pp2_ep2_etp2", "launcher=slurm", "mode.etp=1",
                                     "mode.rollout_num_engines=0"))


def test_cells_that_do_not_fit_the_nodes_are_refused(monkeypatch):
    monkeypatch.setattr(capacity, "available_nodes", lambda cfg: 3)
    capacity.check_capacity(_cfg("mode=dp4", "launcher=slurm", "launcher.nodes=2"))
    with pytest.raises(InputError, match="8 ranks do not fit on 2 node.s. of 3 ranks"):
        capacity.check_capacity(_cfg("mode=dp4_cp2", "launcher=slurm", "launcher.nodes=2", "mode.train_cpus_per_node=3"))
    with pytest.raises(InputError, match="do not fit whole on 3 node.s. of 3 ranks .1 cell.s. per node"):
        capacity.check_capacity(_cfg("mode=dp4_cp2", "launcher=slurm", "launcher.nodes=3", "mode.train_cpus_per_node=3"))
    with pytest.raises(InputError, match="needs 4 train nodes .launcher=slurm has 3."):
        capacity.check_capacity(_cfg("mode=dp4", "launcher=slurm", "launcher.nodes=4"))
