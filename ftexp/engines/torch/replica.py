"""The torch engine's replica: the whole TinyGPT on one rank, with Adam and a constant LR schedule.

One rank holds the whole model, so its parallel coordinates are all 0 and its gradients are
reduced over data parallelism by the caller (``flat_grads`` → SUM → ``set_flat_grads``).

Witnesses (two ``Embedding(B, 1)``, see ``witness.py``) are reduced, stepped, checksummed,
checkpointed and healed like any other parameter, but never clipped or dumped: the clip factor
depends on the policy's parameters alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ftexp.audit.checksums import rng_hashes, tensor_hash
from ftexp.audit.dumps import remove_dumps_at, write_dump
from ftexp.audit.witness import IdRange
from ftexp.config import TrainerConfig
from ftexp.engines.base import (CLIP_GRAD, STAT_KEYS, make_adam_state, rng_state, seed_rngs, set_rng_state,
                               step_metrics)
from ftexp.engines.grpo import TrainBatch
from ftexp.engines.torch.loss import grpo_loss
from ftexp.engines.torch.model import build_model
from ftexp.engines.torch.witness import nonzero_witness_ranges, zero_witness_rows


class TorchReplica:
    """Model + optimizer + scheduler + RNG of one rank (``ftexp.engines.base.Replica``)."""

    reduces_data_parallel = False
    coords = {"pp": 0, "tp": 0, "cp": 0, "ep": 0}

    def __init__(self, trainer_cfg: TrainerConfig, seed: int):
        self.cfg = trainer_cfg
        # In the baseline's world every rank is one DP replica; a cell's single rank has no world.
        self.data_parallel = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        seed_rngs(seed)
        self.model = build_model(trainer_cfg.model,
                                 trainer_cfg.witness_buffer_size if trainer_cfg.witness_on else None)
        self.params = [p for _, p in self.model.named_parameters()]
        self.param_names = [n for n, _ in self.model.named_parameters()]
        witness_params = {id(w.weight) for w in self.model.witnesses().values()}
        policy = [(n, p) for n, p in self.model.named_parameters() if id(p) not in witness_params]
        self.policy_params = [p for _, p in policy]
        self.policy_param_names = [n for n, _ in policy]
        # foreach=False: the single-tensor path, same kernels on every rank and every run.
        self.optimizer = torch.optim.Adam(self.params, lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas),
                                          weight_decay=trainer_cfg.weight_decay, eps=trainer_cfg.adam_eps,
                                          foreach=False)
        make_adam_state(self.optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda=lambda _: 1.0)
        self.last_rollout_id = -1  # the last committed rollout

    # ---- the step -------------------------------------------------------------------------
    def forward_backward(self, batch: TrainBatch, num_samples: int, num_shards: int) -> torch.Tensor:
        """Accumulate this shard's gradients; return its stats as a tensor ordered like STAT_KEYS.

        The loss is normalised by the rollout's sample count, so shards simply SUM (``num_shards``
        does not matter here).
        """
        loss, stats = grpo_loss(self.model, batch, num_samples, eps_clip=self.cfg.eps_clip)
        loss.backward()
        stats = {"loss": loss.detach(), **stats}
        return torch.stack([stats[k].to(torch.float32) for k in STAT_KEYS])

    def forward_backward_reduce(self, batch: TrainBatch, num_samples: int, num_shards: int,
                                before_reduce: Callable[[], None],
                                reduce: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
        """Forward/backward, then ``reduce`` [grads, stats] across replicas; the reduced stats, or None if it failed."""
        stats = self.forward_backward(batch, num_samples, num_shards)
        before_reduce()
        flat = self.flat_grads(stats)
        if not reduce(flat):
            return None
        return self.set_flat_grads(flat)

    def flat_grads(self, extra: torch.Tensor) -> torch.Tensor:
        """One contiguous buffer [all grads..., extra] so one collective reduces everything."""
        return torch.cat([p.grad.reshape(-1) for p in self.params] + [extra])

    def set_flat_grads(self, flat: torch.Tensor) -> torch.Tensor:
        """Copy reduced grads back; return the trailing stats part."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset: offset + n].view_as(p))
            offset += n
        return flat[offset:]

    def cell_agrees(self, ok: bool) -> bool:
        """A cell of one rank agrees with itself."""
        return ok

    def optimizer_step(self, rollout_id: int) -> float:
        """Clip the policy's gradients, step, advance the scheduler; return the pre-clip grad norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy_params, CLIP_GRAD, foreach=False)
        self.optimizer.step()
        self.scheduler.step()
        self.last_rollout_id = rollout_id
        return float(grad_norm)

    @property
    def has_witness(self) -> bool:
        return bool(self.model.witnesses())

    def witness_snapshot(self) -> dict[str, list[IdRange]]:
        """Witness instance id -> the ids of its non-zero rows, as ranges."""
        return {instance: nonzero_witness_ranges(w) for instance, w in self.model.witnesses().items()}

    def zero_stale_witness_rows(self, stale_ranges: list[IdRange]) -> None:
        for witness in self.model.witnesses().values():
            zero_witness_rows(witness, self.optimizer, stale_ranges)

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()

    def metrics(self, stats: torch.Tensor, grad_norm: float, rollout: dict) -> dict[str, float]:
        return step_metrics(stats, grad_norm, self.scheduler.get_last_lr()[0], rollout)

    # ---- audit ----------------------------------------------------------------------------
    def dump(self, leaf_dir: Path) -> None:
        """Policy weights and (reduced) grads, before the optimizer step, in sglang's dump format.

        Witnesses are not dumped: 16 MB a rollout at the default buffer size, never comparable
        with the baseline (a retry allocates other ids), and audited by the event analyzer instead.
        """
        remove_dumps_at(leaf_dir, self.coords)  # a retried attempt overwrites, never merges
        index = 0
        for prefix, get in (("weight", lambda p: p), ("grad", lambda p: p.grad)):
            for name, p in zip(self.policy_param_names, self.policy_params):
                index += 1
                write_dump(leaf_dir, f"{prefix}__{name}", get(p), step=0, rank=0, dump_index=index, **self.coords)

    def checksums(self) -> dict[str, Any]:
        """A hash of every parameter, of every optimizer state tensor and of every RNG generator."""
        opt, algorithm = self.optimizer.state_dict(), self.cfg.checksum.value
        return {
            "rng_hashes": rng_hashes(rng_state(), algorithm),
            "param_hashes": {f"pp0.{n}": tensor_hash(p, algorithm) for n, p in zip(self.param_names, self.params)},
            "optimizer_hashes": {
                f"{self.param_names[i]}.{k}": (tensor_hash(v, algorithm) if torch.is_tensor(v) else v)
                for i, st in sorted(opt["state"].items()) for k, v in sorted(st.items())
            },
        }

    # ---- state for checkpoints and healing ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "last_rollout_id": self.last_rollout_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.last_rollout_id = int(state["last_rollout_id"])
