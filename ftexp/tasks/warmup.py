"""The supervised warm-up: teach the initial policy the task's answer format before GRPO.

GRPO from random weights stays at chance on arithmetic (no sample is ever right, so no advantage is
ever non-zero). The run therefore starts with ``task.warmup.steps`` cross-entropy steps on the
task's warm-up split — disjoint from the prompts GRPO trains on and from the eval set — each on a
batch of the prompt, the solution and the end token (``tasks.base.PolicyTokenizer``) with the loss
on the solution and the end token only.

Every cell warms up on its own, before the cells first meet: the same initial weights, the same
batches (a pure function of the experiment seed and the step) and the same kernels, so the cells
come out bitwise equal — optimizer state included — and the cross-replica checksum rule holds from
the first rollout on. A healed cell or a resumed run receives its state instead.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol, Sequence

import torch

from ftexp.config import WarmupConfig
from ftexp.engines.grpo import PAD_TOKEN, TrainBatch
from ftexp.tasks.base import PolicyTokenizer, Problem, Task

log = logging.getLogger(__name__)
LOG_EVERY = 50


class SupervisedReplica(Protocol):
    def supervised_step(self, batch: TrainBatch, lr: float) -> float:
        """One cross-entropy step of this replica alone at learning rate ``lr``; the batch's mean loss."""


def supervised_batch(problems: Sequence[Problem], tokenizer: PolicyTokenizer) -> TrainBatch:
    """Prompt, solution, end token per problem, right-padded; the loss mask covers solution and end token."""
    sequences = [(tokenizer.encode(p.prompt), tokenizer.encode(p.solution) + [tokenizer.end_id]) for p in problems]
    width = max(len(prompt) + len(answer) for prompt, answer in sequences)
    tokens = torch.full((len(problems), width), PAD_TOKEN, dtype=torch.long)
    loss_mask = torch.zeros(len(problems), width - 1)
    for row, (prompt, answer) in enumerate(sequences):
        tokens[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        # Target position t predicts token t+1: the answer's tokens are targets len(prompt)-1 onwards.
        loss_mask[row, len(prompt) - 1:len(prompt) + len(answer) - 1] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=loss_mask, old_log_probs=torch.zeros_like(loss_mask),
                      advantages=torch.ones(len(problems)), sample_indices=torch.arange(len(problems)))


def warm_up(replica: SupervisedReplica, task: Task, cfg: WarmupConfig, seed: int, announce: bool,
            tokenizer: PolicyTokenizer) -> list[float]:
    """Run the warm-up on ``replica`` (every rank of the replica calls it); the loss of every step.

    ``announce``: this rank logs the progress (one rank per cell is enough).
    """
    started, losses = time.monotonic(), []
    for step in range(cfg.steps):
        losses.append(replica.supervised_step(supervised_batch(task.warmup_problems(step, cfg.batch_size, seed),
                                                               tokenizer), cfg.lr))
        if announce and (step + 1) % LOG_EVERY == 0:
            log.info("warm-up step %d/%d: loss %.4f", step + 1, cfg.steps, losses[-1])
    if announce and losses:
        log.info("warm-up: %d supervised steps of %d %s problems in %.1f s, loss %.4f -> %.4f", cfg.steps,
                 cfg.batch_size, task.name, time.monotonic() - started, losses[0], losses[-1])
    return losses
