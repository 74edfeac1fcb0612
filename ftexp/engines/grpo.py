"""The GRPO training-step math every engine shares: advantages, data sharding and the PPO-clip core.

The loss is written so that data parallelism is a pure SUM: a shard's loss is the sum of its
samples' losses divided by the number of samples in the WHOLE rollout. Summing the shard
losses (and their gradients) over any partition of the rollout therefore gives the loss (and
gradient) of the global mean, which is what both the plain-DP baseline and the fault-tolerant
cells all-reduce with SUM. Advantages are normalised per prompt group over the whole rollout,
before sharding, so they do not depend on how the rollout is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ftexp.errors import InputError

PAD_TOKEN = 0
ADVANTAGE_EPS = 1e-6


@dataclass
class TrainBatch:
    """One shard of a rollout as tensors; the T-1 axis indexes next-token targets."""

    tokens: torch.Tensor  # [B, T] long, right-padded with PAD_TOKEN
    loss_mask: torch.Tensor  # [B, T-1] float, 1 where the target is a trained response token
    old_log_probs: torch.Tensor  # [B, T-1] float, rollout-time log-probs (0 off the mask)
    advantages: torch.Tensor  # [B] float
    sample_indices: torch.Tensor  # [B] long, positions in the whole rollout
    witness_ids: torch.Tensor | None = None  # [B] long, each sample's witness id


def group_advantages(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """GRPO advantages: each reward normalised within its contiguous group of samples."""
    if n_samples_per_prompt < 1 or rewards.numel() % n_samples_per_prompt:
        raise InputError(f"{rewards.numel()} rewards do not form whole groups of {n_samples_per_prompt}")
    groups = rewards.view(-1, n_samples_per_prompt)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + ADVANTAGE_EPS)).view(-1)


def strided_shard(num_samples: int, rank: int, size: int) -> list[int]:
    """Indices of the samples of shard ``rank`` out of ``size``: sample i goes to shard i % size."""
    if not 0 <= rank < size:
        raise InputError(f"shard rank {rank} is outside [0, {size})")
    return list(range(rank, num_samples, size))


def make_train_batch(rollout: dict[str, Any], sample_indices: list[int],
                     witness_ids: list[int] | None = None) -> TrainBatch:
    """Tensorise the chosen samples of a (validated) rollout.

    ``witness_ids`` holds one id per sample of the *whole* rollout; the batch keeps the chosen ones.
    """
    samples = rollout["samples"]
    if witness_ids is not None and len(witness_ids) != len(samples):
        raise InputError(f"{len(witness_ids)} witness ids for a rollout of {len(samples)} samples")
    rewards = torch.tensor([float(s["reward"]) for s in samples], dtype=torch.float32)
    all_advantages = group_advantages(rewards, rollout["metadata"]["n_samples_per_prompt"])
    # Pad to the longest sequence of the whole rollout, not of the shard, so a shard's tensor
    # shapes never depend on how the rollout was split.
    seq_len = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(sample_indices), seq_len), PAD_TOKEN, dtype=torch.long)
    loss_mask = torch.zeros(len(sample_indices), seq_len - 1)
    old_log_probs = torch.zeros(len(sample_indices), seq_len - 1)
    for row, index in enumerate(sample_indices):
        sample = samples[index]
        length, response_length = len(sample["tokens"]), sample["response_length"]
        tokens[row, :length] = torch.tensor(sample["tokens"])
        # Target position t predicts token t+1, so the response occupies targets
        # [length - response_length - 1, length - 1).
        start = length - response_length - 1
        loss_mask[row, start:length - 1] = torch.tensor(sample["loss_mask"], dtype=torch.float32)
        old_log_probs[row, start:length - 1] = torch.tensor(sample["rollout_log_probs"],
                                                            dtype=torch.float32)
    indices = torch.tensor(sample_indices, dtype=torch.long)
    return TrainBatch(tokens=tokens, loss_mask=loss_mask, old_log_probs=old_log_probs,
                      advantages=all_advantages[indices], sample_indices=indices,
                      witness_ids=torch.tensor(witness_ids, dtype=torch.long)[indices] if witness_ids is not None else None)


def token_advantages(batch: TrainBatch) -> tuple[list[list[float]], list[list[int]]]:
    """Per sample of the batch: the advantage and the witness id of each trained (loss-mask) token."""
    advantages, witness_ids = [], []
    for row in range(batch.tokens.shape[0]):
        num_tokens = int(batch.loss_mask[row].sum())
        advantages.append([float(batch.advantages[row])] * num_tokens)
        witness_ids.append([int(batch.witness_ids[row])] * num_tokens)
    return advantages, witness_ids


def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: (loss per token, whether the clipped branch was taken).

    ``log_ratio`` = new − old log-prob of each token; ``advantages`` broadcast over its tokens.
    """
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * advantages
    return torch.maximum(unclipped, clipped), clipped > unclipped
