"""The torch engine's GRPO loss: PPO-clip on TinyGPT, normalised so that shards SUM to the rollout mean."""

from __future__ import annotations

import torch

from ftexp.engines.grpo import TrainBatch, ppo_clip
from ftexp.engines.torch.model import TinyGPT, gather_targets, next_token_log_softmax


def grpo_loss(model: TinyGPT, batch: TrainBatch, num_samples_global: int,
              eps_clip: float = 0.2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss of one shard, normalised by the global sample count.

    Each quantity is first a masked mean over a sample's response tokens, then summed over the
    shard's samples and divided by ``num_samples_global``; summing over shards gives the mean
    over the rollout. Returns the loss and detached 0-d stats normalised the same way.
    """
    log_softmax = next_token_log_softmax(model, batch.tokens, batch.witness_ids)
    log_probs = gather_targets(log_softmax, batch.tokens)
    pg_per_token, clipped = ppo_clip(log_probs - batch.old_log_probs, batch.advantages.unsqueeze(1), eps_clip)

    # Samples whose mask is empty contribute zero instead of dividing by zero.
    tokens_per_sample = batch.loss_mask.sum(dim=1).clamp(min=1.0)

    def shard_sum_of_sample_means(per_token: torch.Tensor) -> torch.Tensor:
        per_sample = (per_token * batch.loss_mask).sum(dim=1) / tokens_per_sample
        return per_sample.sum() / num_samples_global

    loss = shard_sum_of_sample_means(pg_per_token)
    with torch.no_grad():
        entropy_per_token = -(log_softmax.exp() * log_softmax).sum(dim=-1)
        stats = {
            "pg_loss": loss.detach().clone(),
            "pg_clipfrac": shard_sum_of_sample_means(clipped.float()),
            "ppo_kl": shard_sum_of_sample_means(batch.old_log_probs - log_probs),
            "entropy": shard_sum_of_sample_means(entropy_per_token),
        }
    return loss, stats
