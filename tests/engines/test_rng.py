"""RNG generators are part of a replica's audited state: hashed in every checksum event, advanced once per commit."""

import random

import numpy as np
import torch

from ftexp.audit.checksums import rng_hashes
from ftexp.config import TrainerConfig
from ftexp.engines.base import draw_step_randomness, rng_state, seed_rngs, set_rng_state
from ftexp.engines.torch.replica import TorchReplica


def test_rng_hashes_name_every_generator_and_follow_its_state():
    seed_rngs(3)
    before = rng_hashes(rng_state())
    assert set(before) == {"torch", "python", "numpy"}
    saved = rng_state()
    draw_step_randomness()
    after = rng_hashes(rng_state())
    assert all(after[k] != before[k] for k in before)  # one draw moves every generator
    set_rng_state(saved)
    assert rng_hashes(rng_state()) == before
    # Each generator on its own changes its own hash only.
    random.random()
    moved = rng_hashes(rng_state())
    assert moved["python"] != before["python"] and (moved["torch"], moved["numpy"]) == (before["torch"], before["numpy"])
    np.random.random()
    torch.rand(1)
    assert rng_hashes(rng_state())["numpy"] != before["numpy"]


def test_a_replica_checksums_its_generators():
    """A heal that keeps the fresh process's generators differs from its source in rng_hashes alone."""
    replica = TorchReplica(TrainerConfig(enable_witness=False), seed=1)
    fresh = replica.checksums()  # what a cell just built (the same seed) holds
    draw_step_randomness()       # a committed step: the generators move, nothing else does
    trained = replica.checksums()
    assert set(trained) == {"param_hashes", "optimizer_hashes", "rng_hashes"}
    assert trained["rng_hashes"] != fresh["rng_hashes"]
    assert (trained["param_hashes"], trained["optimizer_hashes"]) == (fresh["param_hashes"], fresh["optimizer_hashes"])
