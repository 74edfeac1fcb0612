"""Test-side Megatron training and TP shard bookkeeping, for comparing layouts with one rank.

`train_step` runs one optimizer step over a list of microbatches through Megatron's own schedule
(`get_forward_backward_func`) on a model from `ftexp.engines.megatron.model`.

Loss convention (Megatron's): each microbatch's loss is the mean over its tokens. Under CP a rank
returns its local sum ÷ the sequence's global token count; the schedule multiplies by the CP size
and the DP×CP grad average divides it back, so gradients equal those of the unsplit sequence.

Every parameter has a global name (`global_names`) and knows how it is split over TP
(`ShardInfo`), so shards from any layout can be compared with, or loaded from, a single-rank model
(`local_shards`, `load_full_state`, `assemble_full`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from ftexp.engines.megatron.model import global_names
from ftexp.engines.megatron.presets import PRESETS


def synthetic_microbatches(preset_name: str, count: int, batch_size: int = 1, seed: int = 0) -> list[dict]:
    """Random token microbatches (labels = next token), the same on every rank for a given seed."""
    preset = PRESETS[preset_name]
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, preset.vocab_size, (batch_size, preset.seq_length + 1), generator=generator)
        batches.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch_size, preset.seq_length),
            "position_ids": torch.arange(preset.seq_length).expand(batch_size, -1).contiguous(),
        })
    return batches


def _loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Local loss sum ÷ global token count; reports the full microbatch's mean loss."""
    cp_group = parallel_state.get_context_parallel_group()
    local_sum = (per_token_loss.float() * loss_mask).sum()
    counts = torch.stack([local_sum.detach(), loss_mask.sum()])
    torch.distributed.all_reduce(counts, group=cp_group)
    num_tokens = counts[1].clamp(min=1)  # a fully masked microbatch contributes nothing, not NaN
    return local_sum / num_tokens, {"lm loss": counts[0] / num_tokens}


def _forward_step(data_iterator, model):
    batch = get_batch_on_this_cp_rank({k: v.clone() for k, v in next(data_iterator).items()})
    output = model(
        input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None, labels=batch["labels"]
    )
    return output, partial(_loss, batch["loss_mask"])


def forward_backward(model, microbatches: list[dict], forward_only: bool = False) -> float:
    """Run Megatron's schedule over `microbatches`; return their mean loss, averaged over DP."""
    first = microbatches[0]["tokens"]
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=first.shape[1],  # the full sequence: the schedule divides by CP (and TP under SP)
        micro_batch_size=first.shape[0],
        forward_only=forward_only,
    )
    # Only the last pipeline stage computes the loss: share it with the other stages, then
    # average over data-parallel replicas so every rank reports the global-batch loss.
    loss = torch.zeros(())
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([r["lm loss"] for r in reports]).mean()
    torch.distributed.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


class StepResult(NamedTuple):
    loss: float  # global-batch mean loss (same on every rank)
    grad_norm: float  # total grad norm before clipping, over the whole model


def train_step(model, optimizer, microbatches: list[dict], on_grads=None) -> StepResult:
    """One optimizer step; `on_grads(model)` sees the reduced grads before the optimizer changes them."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, microbatches)
    if on_grads is not None:
        on_grads(model)
    succeeded, grad_norm, _ = optimizer.step()
    if not succeeded:
        raise RuntimeError("Megatron optimizer step was skipped")
    return StepResult(loss, grad_norm)


# ---- TP sharding --------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardInfo:
    """Where a local tensor sits in the full tensor: its TP slice along `dim` (Megatron's stride)."""

    tp_rank: int = 0
    tp_size: int = 1
    dim: int = 0
    stride: int = 1  # >1: the rank holds `stride` interleaved pieces (e.g. [gate_r; up_r] of SwiGLU fc1)


def _unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _shard_info(name: str, param: torch.Tensor) -> ShardInfo:
    if not getattr(param, "tensor_model_parallel", False):
        return ShardInfo()
    ps = parallel_state
    if ".experts." in name:  # experts are split over the expert-TP group, not the dense TP group
        rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    else:
        rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    return ShardInfo(rank, size, param.partition_dim, param.partition_stride)


def local_shards(model, grads: bool = False) -> dict[str, tuple[torch.Tensor, ShardInfo]]:
    """This rank's parameters (or their reduced grads), keyed by global name, with their TP placement."""
    model = _unwrap(model)
    names = global_names(model)
    shards = {}
    for name, param in model.named_parameters():
        tensor = param.main_grad if grads else param.data
        shards[names[name]] = (tensor.detach().clone(), _shard_info(name, param))
    return shards


def shard_of(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The piece of `full` a rank holds: pieces rank, rank+tp, ... of tp·stride equal splits."""
    pieces = full.chunk(info.tp_size * info.stride, dim=info.dim)
    return torch.cat(pieces[info.tp_rank :: info.tp_size], dim=info.dim)


def assemble_full(shards: list[tuple[torch.Tensor, ShardInfo]]) -> torch.Tensor:
    """Inverse of `shard_of` given one shard per TP rank (replicas of a rank are ignored)."""
    by_rank = {info.tp_rank: (tensor, info) for tensor, info in shards}
    _, info = by_rank[0]
    if info.tp_size == 1:
        return by_rank[0][0]
    split = [by_rank[r][0].chunk(info.stride, dim=info.dim) for r in range(info.tp_size)]
    return torch.cat([split[r][s] for s in range(info.stride) for r in range(info.tp_size)], dim=info.dim)


def load_full_state(model, full_state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of an unsplit model's parameters (keyed by global name) into `model`.

    Call before `wrap_for_training`: a distributed optimizer copies the weights when built.
    """
    model = _unwrap(model)
    names = global_names(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard_of(full_state[names[name]], _shard_info(name, param)))
