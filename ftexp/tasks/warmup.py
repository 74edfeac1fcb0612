"""The supervised warm-up: teach the initial policy the task's answer format before GRPO.

GRPO from random weights stays at chance on arithmetic (no sample is ever right, so no advantage is
ever non-zero). The run therefore starts with ``task.warmup.steps`` cross-entropy steps on the
task's warm-up split — disjoint from the prompts GRPO trains on and from the eval set — each on a
batch of the prompt, the solution and the end token (``tasks.base.PolicyTokenizer``) with the loss
on the solution and the end token only.

The warm-up is a pure function of the initial weights, the experiment seed (the batches) and the
kernels, so it is computed once per run (``warm_start``): the first cell's ranks warm up and hand
their state over in the run dir, and every other cell's ranks load it — the cells start bitwise
equal, optimizer state included, and the cross-replica checksum rule holds from the first rollout
on. With ``task.warmup.cache_dir`` the state is also kept across runs, under a key of everything it
depends on (``warmup_key``): a sweep's points that share a seed warm up once. A healed cell or a
resumed run receives its state instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from ftexp.atomic_files import torch_save_atomically
from ftexp.config import ModeConfig, TaskConfig, TrainerConfig, WarmupConfig
from ftexp.engines.grpo import PAD_TOKEN, TrainBatch
from ftexp.job import JobSpec
from ftexp.tasks import build_task
from ftexp.tasks.base import PolicyTokenizer, Problem, Task, policy_tokenizer

log = logging.getLogger(__name__)
LOG_EVERY = 50
# Bump when the warm-up computes something else from the same settings: older cache entries then miss.
CACHE_FORMAT = 1
# Trainer settings the warmed-up state does not depend on (GRPO's loss, sampling, timeouts, retries,
# the audit): runs that differ only in them share a cache entry.
TRAINER_FIELDS_OUTSIDE_THE_STATE = ("rollout", "eps_clip", "world_timeout_s", "cross_cell_timeout_s", "max_attempts",
                                    "retry_backoff_s", "retry_backoff_max_s", "negative_control", "audit", "checksum",
                                    "spare_cells", "fresh_baseline_ranks", "rollouts_per_call")
HANDOFF_POLL_S = 0.5
HANDOFF_DEADLINE_S = 3600.0  # the first cell's warm-up; a dead first cell fails the run's start long before


class SupervisedReplica(Protocol):
    def supervised_step(self, batch: TrainBatch, lr: float) -> float:
        """One cross-entropy step of this replica alone at learning rate ``lr``; the batch's mean loss."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


# ---- once per run, and across runs -------------------------------------------------------------
def warmup_key(mode: ModeConfig, trainer: TrainerConfig, task: TaskConfig, seed: int, deterministic: bool) -> str:
    """A hash of everything the warmed-up state depends on: equal keys, bitwise-equal states."""
    trainer_fields = {k: v for k, v in dataclasses.asdict(trainer).items() if k not in TRAINER_FIELDS_OUTSIDE_THE_STATE}
    task_fields = dataclasses.asdict(task)
    task_fields["warmup"].pop("cache_dir")
    parts = {"format": CACHE_FORMAT, "torch": torch.__version__, "mode": dataclasses.asdict(mode),
             "trainer": trainer_fields, "task": task_fields, "seed": seed, "deterministic": deterministic,
             "checkpoint": _checkpoint_files(mode.hf_checkpoint)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _checkpoint_files(checkpoint: str | None) -> list[tuple[str, int, int]]:
    """An HF checkpoint's files by name, size and mtime: a checkpoint rewritten in place is another key."""
    if checkpoint is None:
        return []
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(Path(checkpoint).iterdir()) if f.is_file()]


def rank_file(rank_within_cell: int) -> str:
    return f"rank{rank_within_cell}.pt"


def cached_warmup(cache_dir: str | None, key: str, ranks_per_cell: int) -> Path | None:
    """The cache entry holding every rank's warmed-up state under ``key``, or None (a miss).

    Asked once, before the job starts, so every rank of the run agrees on where its state comes from."""
    if cache_dir is None:
        return None
    entry = Path(cache_dir) / key
    complete = all((entry / rank_file(r)).exists() for r in range(ranks_per_cell))
    return entry if complete else None


def warm_start(replica: SupervisedReplica, spec: JobSpec, cell_index: int, rank_within_cell: int) -> None:
    """Bring a cold-started rank to the warmed-up state: from the cache, by warming up, or from the first cell."""
    cfg = spec.task.warmup
    if spec.warmup_cached is not None:
        replica.load_state_dict(_load(spec.warmup_cached / rank_file(rank_within_cell)))
        if rank_within_cell == 0:
            log.info("warm-up: loaded from the cache %s", spec.warmup_cached)
        return
    handoff = spec.side_dir.warmup / rank_file(rank_within_cell)
    if cell_index != 0:
        replica.load_state_dict(_wait_and_load(handoff))
        if rank_within_cell == 0:
            log.info("warm-up: loaded the first cell's state from %s", handoff.parent)
        return
    warm_up(replica, build_task(spec.task), cfg, spec.seed, announce=rank_within_cell == 0,
            tokenizer=policy_tokenizer(spec.mode))
    state = replica.state_dict()
    torch_save_atomically(state, handoff)
    if cfg.cache_dir is not None:
        key = warmup_key(spec.mode, spec.trainer, spec.task, spec.seed, spec.deterministic)
        target = Path(cfg.cache_dir) / key / rank_file(rank_within_cell)
        if not target.exists():  # an entry is written once: a concurrent run's equal state stays
            torch_save_atomically(state, target)


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)


def _wait_and_load(path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + HANDOFF_DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the first cell's warm-up state never appeared at {path}")
        time.sleep(HANDOFF_POLL_S)
    return _load(path)
