"""One model replica's training state and its step, shared by both sides of an experiment.

A plain-DP rank (baseline) and a cell's rank (target) hold the same thing: a model, an Adam
optimizer, a constant LR scheduler, RNG states and the id of the last committed rollout. Both
run the same step — forward/backward on their strided shard of the rollout, SUM-reduce the
flat gradient buffer across replicas, then step — and differ only in the group they reduce over
and in what happens when the reduce fails. Keeping that step in one place is what makes the
two sides comparable bit for bit.

The step also keeps the witness audit trail (spec §11): it logs each local sample's advantages
with its witness id, and after a committed step the non-zero witness rows, then zeroes the stale
ones. Witness parameters are reduced, stepped, checksummed, checkpointed and healed like any
other, but never clipped or dumped: the clip factor depends on the policy's parameters alone.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ftexp.audit.dumps import remove_dumps_at, write_dump
from ftexp.audit.events import EventLogger, TrainAdvantageComputationEvent, WitnessSnapshotParamEvent
from ftexp.audit.witness import IdRange, WitnessInfo
from ftexp.trainer.grpo import TrainBatch, grpo_loss, make_train_batch, strided_shard, token_advantages
from ftexp.trainer.model import build_model
from ftexp.trainer.witness_module import nonzero_witness_ids, zero_witness_rows

# Per-shard statistics reduced alongside the gradients; each is already normalised so that the
# SUM over shards is the global mean.
STAT_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy")
# Megatron's default gradient clipping.
CLIP_GRAD = 1.0


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


class Replica:
    """Model + optimizer + scheduler + RNG of one rank, with the step split into its phases.

    The torch engine: one rank holds the whole model, so its parallel coordinates are all 0 and
    the caller reduces its gradients over data parallelism (``flat_grads`` → SUM → ``set_flat_grads``).
    ``ftexp.engines.megatron.replica.MegatronReplica`` is the other engine with the same surface.
    """

    dp_reduced_internally = False
    coords = {"pp": 0, "tp": 0, "cp": 0, "ep": 0}

    def __init__(self, trainer_cfg, seed: int):
        self.cfg = trainer_cfg
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
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

    def witness_snapshot(self) -> dict[str, list[int]]:
        """Witness instance id -> the ids of its non-zero rows."""
        return {instance: nonzero_witness_ids(w) for instance, w in self.model.witnesses().items()}

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
        """SHA-256 of every parameter and of the optimizer state (spec §10.2)."""
        opt = self.optimizer.state_dict()
        return {
            "param_hashes": {f"pp0.{n}": tensor_sha256(p) for n, p in zip(self.param_names, self.params)},
            "optimizer_hashes": {
                f"{self.param_names[i]}.{k}": (tensor_sha256(v) if torch.is_tensor(v) else v)
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


def step_metrics(stats: torch.Tensor, grad_norm: float, lr: float, rollout: dict) -> dict[str, float]:
    """The metrics of a committed step, the same keys for every engine."""
    out = {f"train/{k}": float(v) for k, v in zip(STAT_KEYS, stats)}
    out["train/grad_norm"] = grad_norm
    out["train/lr"] = lr
    out["rollout/reward_mean"] = float(np.mean([s["reward"] for s in rollout["samples"]]))
    return out


def rng_state() -> dict[str, Any]:
    """Every RNG a rank draws from; healed and checkpointed with the model."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def train_step(replica: Replica, rollout: dict, rollout_id: int, attempt: int, *, shard_rank: int, shard_size: int,
               witness: WitnessInfo | None, events: EventLogger, reduce: Callable[[torch.Tensor], bool],
               before_reduce: Callable[[], None] = lambda: None,
               on_commit: Callable[[], None] = lambda: None) -> tuple[bool, dict[str, float] | None]:
    """The step both sides run. ``reduce`` SUMs the flat buffer in place and says whether it worked.

    On failure the gradients are dropped and nothing is stepped, so a discarded attempt leaves no
    trace in weights or optimizer state. ``on_commit`` runs after the reduce and before the
    optimizer step (that is where weights and reduced grads are dumped). ``witness`` (one id per
    sample of the rollout) is required exactly when the replica's model has witnesses.
    """
    if (witness is not None) != replica.has_witness:
        raise ValueError("witness ids must be given exactly when the model has witnesses (trainer.enable_witness)")
    num_samples = len(rollout["samples"])
    batch = make_train_batch(rollout, strided_shard(num_samples, shard_rank, shard_size),
                             witness.witness_ids if witness is not None else None)
    if witness is not None:
        advantages, token_witness_ids = token_advantages(batch)
        events.log(TrainAdvantageComputationEvent(rollout_id=rollout_id, attempt=attempt, advantages=advantages,
                                                  witness_ids=token_witness_ids))
    replica.zero_grad()
    stats = replica.forward_backward_reduce(batch, num_samples, shard_size, before_reduce, reduce)
    if stats is None:
        replica.zero_grad()
        return False, None
    on_commit()
    grad_norm = replica.optimizer_step(rollout_id)
    metrics = replica.metrics(stats, grad_norm, rollout)
    replica.zero_grad()
    if witness is not None:
        for instance, nonzero in replica.witness_snapshot().items():
            events.log(WitnessSnapshotParamEvent(rollout_id=rollout_id, attempt=attempt, instance_id=instance,
                                                 nonzero_witness_ids=nonzero, stale_id_ranges=witness.stale_ranges))
        replica.zero_stale_witness_rows(witness.stale_ranges)
    return True, metrics


def checkpoint_file(coords: dict[str, int]) -> str:
    """One file per rank of a replica, named by its parallel coordinates: ``state_pp0_tp1_cp0_ep1.pt``."""
    return "state_" + "_".join(f"{k}{coords[k]}" for k in ("pp", "tp", "cp", "ep")) + ".pt"


def save_checkpoint(replica, ckpt_root: Path, rollout_id: int) -> Path:
    """This rank's ``<ckpt_root>/iter_<id:07d>/state_<coords>.pt``; returns the iter dir."""
    iter_dir = ckpt_root / f"iter_{rollout_id:07d}"
    iter_dir.mkdir(parents=True, exist_ok=True)
    name = checkpoint_file(replica.coords)
    tmp = iter_dir / f"{name}.tmp"
    torch.save(replica.state_dict(), tmp)
    tmp.replace(iter_dir / name)
    return iter_dir


def mark_checkpoint_complete(ckpt_root: Path, rollout_id: int) -> None:
    """The ``latest_checkpointed_iteration.txt`` tracker: written once every rank's file is."""
    (ckpt_root / "latest_checkpointed_iteration.txt").write_text(f"{rollout_id}\n")


def latest_checkpoint(ckpt_root: Path) -> int | None:
    tracker = ckpt_root / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def load_checkpoint(ckpt_root: Path, rollout_id: int, coords: dict[str, int]) -> dict[str, Any]:
    path = ckpt_root / f"iter_{rollout_id:07d}" / checkpoint_file(coords)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint {path} (was it written by another parallel layout?)")
    return torch.load(path, map_location="cpu", weights_only=False)
