"""One rank of a megatron-core model replica, with the same step phases as the torch engine's Replica.

A replica is ``tp·pp·cp`` ranks (EP splits the experts over those ranks); Megatron's parallel
state must already span exactly the ranks this process shares data parallelism with:

* baseline (plain DP): one gloo world of ``dp × ranks-per-replica`` ranks, Megatron DP = dp;
  its DDP reduces gradients over DP itself (``reduces_data_parallel``);
* target (a cell): the cell's own gloo world, Megatron DP = 1; the cell rank then averages its
  gradient buffers with the same rank of every other alive cell, inside Megatron's grad sync
  (``forward_backward_reduce``), which makes the cells one more data-parallel dimension.

GRPO on Megatron (loss in ``grpo_loss_func``): every sample's loss is the mean over its response
tokens; a rank's microbatch losses are scaled so that, after the schedule's ``÷ num_microbatches``
they are the mean over the rank's shard, and the shard's weight ``rows · shards / samples`` (applied
through Megatron's ``grad_scale_func``, which scales the MoE aux loss too) turns the DP average of
those means into the mean over all samples of the rollout — for any split of the rollout over
ranks and microbatches, uneven shards included (3 cells of 86/85/85 samples). Statistics are summed
over shards like the torch engine's. MoE routers use the sequence-level aux loss, a per-sample term
averaged over a microbatch's rows, so microbatches hold only real samples (never padding rows) and
all have the same size.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ftexp.audit.checksums import hash_tree, rng_hashes, tensor_hash
from ftexp.audit.dumps import remove_dumps_at, write_dump
from ftexp.engines.base import (CLIP_GRAD, STAT_KEYS, make_adam_state, rng_state, seed_rngs, set_rng_state,
                               step_metrics)
from ftexp.engines.collectives import sum_across
from ftexp.engines.grpo import PAD_TOKEN, TrainBatch, ppo_clip
from ftexp.engines.megatron.hf_export import gather_full_tensors, to_hf


def _mp():
    from megatron.core import parallel_state

    return parallel_state


def pad_to(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


class MegatronReplica:
    """Model shard + Megatron DDP + optimizer + RNG of one rank, split into the step's phases."""

    reduces_data_parallel = True

    def __init__(self, trainer_cfg, mode, seed: int, deterministic: bool = False):
        """``mode`` (``ftexp.config.ModeConfig``): the replica's parallel layout and its model
        (``model_preset``, or ``hf_checkpoint``: then every rank loads its shard of the checkpoint's weights)."""
        from ftexp.engines.megatron import model as mg
        from ftexp.engines.megatron.hf_import import model_preset

        self.cfg, self.mode, self.deterministic = trainer_cfg, mode, deterministic
        self.preset = model_preset(mode)
        # The init seed is the model's (trainer.model.seed: the experiment's seed unless set); the
        # replica's seed drives the RNGs after.
        module = mg.build_gpt(self.preset, mode, seed=trainer_cfg.model.seed)
        self.global_names = mg.global_names(module)
        if mode.hf_checkpoint:  # before the optimizer is made around the parameters
            from ftexp.engines.megatron.hf_import import load_shard, open_checkpoint

            load_shard(module, self.global_names, open_checkpoint(mode.hf_checkpoint))
        if deterministic:  # after build_gpt: its CPU patches rebind the same module globals
            from ftexp.engines.megatron.deterministic import use_fixed_order_grad_reduce

            use_fixed_order_grad_reduce()
        seed_rngs(seed)
        self.model, self.optimizer = mg.wrap_for_training(
            module, lr=trainer_cfg.lr, adam_eps=trainer_cfg.adam_eps, clip_grad=CLIP_GRAD,
            betas=tuple(trainer_cfg.betas), weight_decay=trainer_cfg.weight_decay)
        for wrapper in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):  # dense, experts
            make_adam_state(wrapper.optimizer)
        self.module = module
        ps = _mp()
        self.coords = {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
                       "cp": ps.get_context_parallel_rank(), "ep": ps.get_expert_model_parallel_rank()}
        self.data_parallel = (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        self.micro_batch_target = trainer_cfg.megatron.micro_batch_size
        self.last_rollout_id = -1
        self.has_witness = False
        self._after_grad_sync: Callable[[], None] | None = None
        self.model.finish_grad_sync = partial(self._finish_grad_sync, self.model.finish_grad_sync)

    # ---- the step -------------------------------------------------------------------------
    def forward_backward_reduce(self, batch: TrainBatch, num_samples: int, num_shards: int,
                                before_reduce: Callable[[], None],
                                reduce: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
        """Megatron's schedule on this shard, with the reduce across replicas run inside it.

        ``reduce`` SUMs [grads ÷ cross-replica size, stats] over the caller's group (the other
        cells' same rank; nothing in the baseline, whose DDP already reduced over DP). It runs
        where Megatron's own DP reduce ends (DDP's ``finish_grad_sync``) and before the rest of
        ``finalize_model_grads`` all-reduces the sequence-parallel norm and router grads over TP,
        so a cell adds in the same order as the baseline's larger DP group: bit for bit in
        deterministic mode, where the 1/size scalings (powers of two) are exact. Returns the
        rollout's stats (STAT_KEYS order), or None if the reduce failed.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        microbatches, seq_len = self._microbatches(batch)
        rows = batch.tokens.shape[0]
        shard_weight = rows * num_shards / num_samples  # exactly 1.0 for even shards
        self.model.config.grad_scale_func = lambda loss: loss * shard_weight
        self._stats = torch.zeros(len(STAT_KEYS))
        loss_func = partial(grpo_loss_func, loss_scale=len(microbatches) / rows,
                            stat_scale=1.0 / num_samples, eps_clip=self.cfg.eps_clip, on_stats=self._stats.add_)
        outcome: dict[str, Any] = {}

        def reduce_across_replicas() -> None:
            ps = _mp()
            stats = self._stats  # this rank's share: sum it over the replica's CP chunks, stages and DP ranks
            for group in (ps.get_context_parallel_group(), ps.get_pipeline_model_parallel_group(),
                          ps.get_data_parallel_group()):
                sum_across(group, stats, world_size=dist.get_world_size(group), deterministic=self.deterministic,
                           torchft=False)
            before_reduce()
            scale = ps.get_data_parallel_world_size() / num_shards  # 1 in the baseline, 1/alive in a cell
            buffers = self._grad_buffers()
            flat = torch.cat([g.reshape(-1) * scale for g in buffers] + [stats])
            outcome["ok"] = reduce(flat)
            offset = 0
            for g in buffers:
                g.copy_(flat[offset: offset + g.numel()].view_as(g))
                offset += g.numel()
            outcome["stats"] = flat[offset:]

        self._after_grad_sync = reduce_across_replicas
        try:
            get_forward_backward_func()(
                forward_step_func=partial(_forward_step, loss_func), data_iterator=iter(microbatches),
                model=[self.model], num_microbatches=len(microbatches), seq_length=seq_len,
                micro_batch_size=len(microbatches[0]["tokens"]), forward_only=False)
        finally:
            self._after_grad_sync = None
        return outcome["stats"] if outcome["ok"] else None

    def _finish_grad_sync(self, sync_within_replica, *args, **kwargs) -> None:
        sync_within_replica(*args, **kwargs)
        if self._after_grad_sync is not None:
            self._after_grad_sync()

    def _microbatches(self, batch: TrainBatch) -> tuple[list[dict[str, torch.Tensor]], int]:
        """Equal next-token microbatches of real samples, the sequence padded for CP and SP.

        The microbatch size is the divisor of the shard's rows nearest to ``micro_batch_size`` (by
        ratio): pipeline stages exchange tensors of one shape, and no padding row reaches the MoE aux
        loss. An even shard of 64 rows runs as 2 microbatches of 32; the uneven shards of 3 cells,
        86 and 85 rows, as 2 of 43 and 5 of 17 (a nearest divisor below would make 86 rows 43
        microbatches of 2, and that cell the straggler its peers time out on).
        """
        tokens = batch.tokens
        rows, width = tokens.shape
        multiple = 2 * self.mode.cp * (self.mode.tp if self.mode.sequence_parallel else 1)
        seq_len = pad_to(width - 1, multiple)
        size = min((d for d in range(1, rows + 1) if rows % d == 0),
                   key=lambda d: (abs(math.log(d / self.micro_batch_target)), d))

        def padded(t: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((rows, seq_len), fill, dtype=t.dtype)
            out[:, : t.shape[1]] = t
            return out

        tokens_per_sample = batch.loss_mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        fields = {
            "tokens": padded(tokens[:, :-1], PAD_TOKEN),
            "labels": padded(tokens[:, 1:], PAD_TOKEN),
            "loss_mask": padded(batch.loss_mask, 0.0),
            "sample_weight": padded(batch.loss_mask / tokens_per_sample, 0.0),  # per-token share of its sample's mean
            "old_log_probs": padded(batch.old_log_probs, 0.0),
            "advantages": padded(batch.advantages.unsqueeze(1).expand_as(batch.loss_mask), 0.0),
            "position_ids": torch.arange(seq_len).expand(rows, -1).contiguous(),
        }
        return [{k: v[i:i + size] for k, v in fields.items()} for i in range(0, rows, size)], seq_len

    def _grad_buffers(self) -> list[torch.Tensor]:
        return [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]

    def cell_agrees(self, ok: bool) -> bool:
        """AND over the replica's ranks: its shards step together or not at all."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def optimizer_step(self, rollout_id: int) -> float:
        succeeded, grad_norm, _ = self.optimizer.step()
        if not succeeded:
            raise RuntimeError("Megatron optimizer step was skipped")
        self.last_rollout_id = rollout_id
        return float(grad_norm)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def supervised_step(self, batch: TrainBatch, lr: float) -> float:
        """One cross-entropy step at learning rate ``lr`` on this replica alone (a task's warm-up).

        The loss is the mean over samples of each sample's mean over its loss-mask tokens; nothing
        is reduced across replicas, and no RNG is drawn. Returns the batch's loss.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        microbatches, seq_len = self._microbatches(batch)
        self.model.config.grad_scale_func = lambda loss: loss
        loss = torch.zeros(1)
        loss_func = partial(supervised_loss_func, loss_scale=len(microbatches) / batch.tokens.shape[0],
                            on_loss=loss.add_)
        get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_func), data_iterator=iter(microbatches),
            model=[self.model], num_microbatches=len(microbatches), seq_length=seq_len,
            micro_batch_size=len(microbatches[0]["tokens"]), forward_only=False)
        ps = _mp()
        for group in (ps.get_context_parallel_group(), ps.get_pipeline_model_parallel_group()):
            sum_across(group, loss, world_size=dist.get_world_size(group), deterministic=True, torchft=False)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        try:
            succeeded, _, _ = self.optimizer.step()
        finally:
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.lr
        if not succeeded:
            raise RuntimeError("Megatron optimizer step was skipped")
        self.zero_grad()
        return float(loss) / batch.tokens.shape[0]

    def metrics(self, stats: torch.Tensor, grad_norm: float, rollout: dict) -> dict[str, float]:
        return step_metrics(stats, grad_norm, self.optimizer.param_groups[0]["lr"], rollout)

    # ---- audit ----------------------------------------------------------------------------
    def dump(self, leaf_dir: Path) -> None:
        """This rank's weights and reduced grads (global names), keyed by its (pp, tp, cp, ep)."""
        remove_dumps_at(leaf_dir, self.coords)  # a retried attempt overwrites this rank's files, never merges
        index = 0
        for prefix, get in (("weight", lambda p: p.data), ("grad", lambda p: p.main_grad)):
            for name, p in self.module.named_parameters():
                index += 1
                write_dump(leaf_dir, f"{prefix}__{self.global_names[name]}", get(p), step=0,
                           rank=dist.get_rank(), dump_index=index, **self.coords)

    def checksums(self) -> dict[str, Any]:
        hashes, algorithm = {}, self.cfg.checksum.value
        hash_tree(self.optimizer.state_dict(), "optimizer", hashes, algorithm)
        return {
            "rng_hashes": rng_hashes(rng_state(), algorithm),
            "param_hashes": {f"pp{self.coords['pp']}.{self.global_names[n]}": tensor_hash(p, algorithm)
                             for n, p in self.module.named_parameters()},
            "optimizer_hashes": hashes,
        }

    # ---- weights for rollout engines ----------------------------------------------------------
    def export_hf(self) -> dict[str, torch.Tensor] | None:
        """The replica's whole model under HF checkpoint names, on its first rank; None on the others.

        A collective over the replica's ranks: all of them call it together. In a baseline world
        every rank calls it: only DP rank 0's replica assembles the model, the other DP ranks just
        gather their experts (an expert-parallel group may span DP ranks) and return None.
        """
        full = gather_full_tensors(self.module, self.global_names)
        return None if full is None else to_hf(full, self.preset)

    # ---- state for checkpoints and healing ---------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {n: p.data for n, p in self.module.named_parameters()},
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_state(),
            "last_rollout_id": self.last_rollout_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self.module.named_parameters())
        if set(params) != set(state["model"]):
            raise ValueError(f"state for another layout: parameters differ, e.g. {sorted(set(params) ^ set(state['model']))[:3]}")
        with torch.no_grad():
            for name, value in state["model"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.last_rollout_id = int(state["last_rollout_id"])


def _forward_step(loss_func, data_iterator, model):
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = get_batch_on_this_cp_rank({k: v.clone() for k, v in next(data_iterator).items()})
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None)
    return output, partial(loss_func, batch)


def supervised_loss_func(batch: dict[str, torch.Tensor], logits: torch.Tensor, *, loss_scale: float,
                         on_loss: Callable[[torch.Tensor], Any]):
    """Cross-entropy of one microbatch on this rank's CP chunk: each sample's mean over its loss-mask tokens."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    log_softmax = F.log_softmax(gather_from_tensor_model_parallel_region(logits).float(), dim=-1)
    log_probs = log_softmax.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    loss = -(log_probs * batch["sample_weight"]).sum()
    on_loss(loss.detach().reshape(1))
    return loss * loss_scale, {}


def grpo_loss_func(batch: dict[str, torch.Tensor], logits: torch.Tensor, *, loss_scale: float, stat_scale: float,
                   eps_clip: float, on_stats: Callable[[torch.Tensor], Any]):
    """PPO-clip loss of one microbatch on this rank's CP chunk; logits [b, s, vocab / tp].

    ``sample_weight`` is each response token's share of its sample's mean, so summing over the
    chunk's tokens gives this chunk's part of each sample's mean (CP chunks add up to the whole).
    The stats go to ``on_stats`` as they come, so they are complete before the grads are reduced.
    """
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    log_softmax = F.log_softmax(gather_from_tensor_model_parallel_region(logits).float(), dim=-1)
    log_probs = log_softmax.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    mask, weight, advantages, old = batch["loss_mask"], batch["sample_weight"], batch["advantages"], batch["old_log_probs"]
    pg_per_token, clipped = ppo_clip((log_probs - old) * mask, advantages, eps_clip)
    loss = (pg_per_token * weight).sum() * loss_scale
    with torch.no_grad():
        entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
        pg = (pg_per_token * weight).sum()
        stats = torch.stack([pg, pg, (clipped.float() * weight).sum(),
                             ((old - log_probs) * weight).sum(), (entropy * weight).sum()]) * stat_scale
    on_stats(stats)
    return loss, {}
