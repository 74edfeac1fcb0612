"""What every engine provides: a ``Replica`` (one rank's share of one model replica) and an ``Engine``
(how to build one, how many ranks a replica has, what its layout allows).

A plain-DP rank (baseline) and a cell's rank (target) hold the same thing: a model shard, an
optimizer, RNG states and the id of the last committed rollout. Both run the same step
(``ftexp.trainer.step.train_step``) — forward/backward on their strided shard of the rollout,
SUM-reduce the gradients across replicas through a hook, then step — and differ only in the
group they reduce over and in what happens when the reduce fails. That one step over one
protocol is what makes the two sides comparable bit for bit, whatever the engine.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from ftexp.audit.witness import IdRange
from ftexp.config import ModeConfig, TrainerConfig
from ftexp.engines.grpo import TrainBatch

# Per-shard statistics reduced alongside the gradients; each is already normalised so that the
# SUM over shards is the global mean.
STAT_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy")
# Megatron's default gradient clipping.
CLIP_GRAD = 1.0


class Replica(Protocol):
    """One rank's share of a model replica, with the step split into its phases."""

    coords: dict[str, int]        # parallel coordinates (pp, tp, cp, ep): how dumps and checkpoints are keyed
    has_witness: bool             # the model carries witness embeddings
    last_rollout_id: int          # the last committed rollout
    data_parallel: tuple[int, int]  # (DP rank, DP size) within the world it was built in: the baseline's shard
    reduces_data_parallel: bool   # True: the engine reduces over the baseline's DP ranks itself

    def forward_backward_reduce(self, batch: TrainBatch, num_samples: int, num_shards: int,
                                before_reduce: Callable[[], None],
                                reduce: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
        """Forward/backward, then ``reduce`` [grads, stats] across replicas; the reduced stats, or None."""

    def cell_agrees(self, ok: bool) -> bool:
        """AND of ``ok`` over the replica's ranks: its shards step together or not at all."""

    def optimizer_step(self, rollout_id: int) -> float:
        """Clip, step, advance the schedule; return the pre-clip grad norm."""

    def zero_grad(self) -> None: ...

    def metrics(self, stats: torch.Tensor, grad_norm: float, rollout: dict) -> dict[str, float]: ...

    def witness_snapshot(self) -> dict[str, list[IdRange]]: ...

    def zero_stale_witness_rows(self, stale_ranges: list[IdRange]) -> None: ...

    def dump(self, leaf_dir: Path) -> None:
        """Weights and reduced grads, before the optimizer step, keyed by ``coords``."""

    def checksums(self) -> dict[str, Any]:
        """``param_hashes``, ``optimizer_hashes`` and ``rng_hashes``: what the cross-replica checksum rule compares."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a heal or a checkpoint carries: model, optimizer, RNG, counters."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export_hf(self) -> dict[str, torch.Tensor] | None:
        """The replica's full weights by HF tensor name, on its first rank (None on the others): a
        collective over the replica's ranks. Only engines that can feed live rollout engines have it."""


class Engine(Protocol):
    """An engine as the trainer and the config see it."""

    name: str
    witness_by_default: bool      # whether trainer.enable_witness defaults to on
    needs_process_world: bool     # a replica's ranks talk among themselves (a torch.distributed world per cell)
    preload_modules: tuple[str, ...]  # what the baseline's forkserver imports once for all its ranks

    def ranks_per_replica(self, mode: ModeConfig) -> int: ...

    def model_features(self, mode: ModeConfig) -> frozenset[str]:
        """Which of ``registry.MODEL_FEATURES`` the mode's model has, from the config alone."""

    def validate(self, mode: ModeConfig, trainer: TrainerConfig) -> None:
        """Raise InputError for what this engine cannot run, before anything launches."""

    def build_replica(self, trainer: TrainerConfig, mode: ModeConfig, *, seed: int, deterministic: bool) -> Replica:
        """Build this rank's replica; a multi-rank replica needs its torch.distributed world up first."""

    def vocab_size(self, mode: ModeConfig) -> int: ...

    def write_hf_model_dir(self, mode: ModeConfig, directory: Path) -> None:
        """The mode's model as an HF ``config.json``, what live rollout engines build their model from
        (they receive the weights from the trainer, by HF tensor name, through ``Replica.export_hf``)."""


def make_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of a torch Adam or AdamW its state now, as the first step would make it.

    Zero moments and step 0, so the steps run exactly as on state made lazily. A heal then lands the
    source's moments in these pages, which already exist, instead of in fresh memory (``ftexp.trainer.transfer``).
    """
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("capturable") or group.get("fused"):
            raise ValueError("Adam's state is made up front only for plain Adam (no amsgrad, capturable or fused)")
        for p in group["params"]:
            optimizer.state[p] = {"step": torch.tensor(0.0),
                                  "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def step_metrics(stats: torch.Tensor, grad_norm: float, lr: float, rollout: dict) -> dict[str, float]:
    """The metrics of a committed step, the same keys for every engine."""
    out = {f"train/{k}": float(v) for k, v in zip(STAT_KEYS, stats)}
    out["train/grad_norm"] = grad_norm
    out["train/lr"] = lr
    out["rollout/reward_mean"] = float(np.mean([s["reward"] for s in rollout["samples"]]))
    return out


def seed_rngs(seed: int) -> None:
    """Seed every RNG a rank draws from."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG a rank draws from; healed and checkpointed with the model."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def draw_step_randomness() -> int:
    """One draw from each generator a rank holds, once per committed step.

    A trainer that samples while it trains (dropout, shuffling) moves its generators with every
    step. The stock models sample nothing, so this draw stands in for such a step: the generators
    then advance with training, alike on every rank of every replica (one draw per commit, whatever
    the shard), and a heal or resume that loses them shows in the checksum events' ``rng_hashes``.
    The value itself is not used.
    """
    return int(torch.randint(2**62, ()).item()) ^ random.getrandbits(62) ^ int(np.random.randint(2**62, dtype=np.int64))


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
