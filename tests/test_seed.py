"""The experiment's `seed` drives everything random: the initial weights, the recorded rollouts, every rank's
RNGs and the soak injector — unless trainer.model.seed / trainer.rollout.seed are set explicitly.

Two seeds are two experiments (different rollouts, different initial weights); the same seed is the same
experiment, bit for bit. Checked on the prepare stage's own output, without training.
"""

import hashlib
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from ftexp.cli import CONFIG_MODULE, register_configs, to_config
from ftexp.engines.torch.model import build_model
from ftexp.pipeline import prepare
from ftexp.rundir import rollout_data_dir


@pytest.fixture(scope="module", autouse=True)
def _schemas():
    register_configs()


def _config(*overrides: str):
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=["scenario=no_failure", *overrides]))


def _experiment(tmp_path: Path, name: str, *overrides: str) -> dict[str, str]:
    """What an experiment trains on: the hashes of its recorded rollouts and of its initial weights."""
    cfg = _config(*overrides)
    prepare(cfg, tmp_path / name)
    files = sorted(rollout_data_dir(tmp_path / name).glob("*.pt"))
    assert len(files) == cfg.scenario.num_rollout
    digest = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    weights = b"".join(p.detach().numpy().tobytes() for p in build_model(cfg.trainer.model).parameters())
    digest["weights"] = hashlib.sha256(weights).hexdigest()
    return digest


def test_the_seed_drives_model_init_and_rollouts_unless_each_is_set():
    cfg = _config("seed=7")
    assert (cfg.seed, cfg.trainer.model.seed, cfg.trainer.rollout.seed) == (7, 7, 7)
    cfg = _config("seed=7", "trainer.model.seed=3", "trainer.rollout.seed=5")
    assert (cfg.seed, cfg.trainer.model.seed, cfg.trainer.rollout.seed) == (7, 3, 5)
    assert _config("seed=2", "trainer=megatron").trainer.model.seed == 2  # every trainer group


def test_two_seeds_are_two_experiments_and_one_seed_is_one(tmp_path):
    one, again, two = (_experiment(tmp_path, name, f"seed={seed}") for name, seed in
                       (("one", 1), ("again", 1), ("two", 2)))
    assert one == again
    assert all(one[k] != two[k] for k in one)  # every rollout and the initial weights differ
    # Pinning both seeds makes the experiment's seed no longer matter for what is trained on.
    pinned = ("trainer.model.seed=1", "trainer.rollout.seed=1")
    assert _experiment(tmp_path, "pinned", "seed=2", *pinned) == one
