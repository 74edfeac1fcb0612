"""Tiny megatron-core GPT models with TP / SP / PP / CP / EP, trainable on CPU with gloo.

`build_gpt` sets up Megatron's parallel state for one layout and builds the local shard of a
GPTModel from a preset (local layer spec, fp32, no dropout, CPU initialisation);
`wrap_for_training` adds Megatron's DDP and optimizer (Adam); `train_step` runs one optimizer
step over a list of microbatches through Megatron's own schedule (`get_forward_backward_func`).

Loss convention (Megatron's): each microbatch's loss is the mean over its tokens. Under CP a rank
returns its local sum ÷ the sequence's global token count; the schedule multiplies by the CP size
and the DP×CP grad average divides it back, so gradients equal those of the unsplit sequence.

Every parameter has a global name (layer and expert indices as in the unsplit model) and knows
how it is split over TP (`ShardInfo`), so shards from any layout can be compared with, or loaded
from, a single-rank model (`local_shards`, `load_full_state`, `assemble_full`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from ftexp.engines.megatron.cp_attention import ContextParallelAttention
from ftexp.engines.megatron.cpu_compat import apply_cpu_patches
from ftexp.engines.megatron.presets import PRESETS, GPTPreset


@dataclass(frozen=True)
class Layout:
    """One model replica's parallel layout; the rest of the world is data parallel."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # Expert TP gathers differently sized token sets per rank, which gloo cannot: 1 on CPU.
    expert_tp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None  # uneven pipeline split (Megatron's first/last stage sizes)
    last_stage_layers: int | None = None


def transformer_config(preset: GPTPreset, layout: Layout) -> TransformerConfig:
    moe = {}
    if preset.num_experts:
        moe = dict(
            num_moe_experts=preset.num_experts,
            moe_ffn_hidden_size=preset.ffn_hidden_size,
            moe_router_topk=preset.moe_router_topk,
            moe_token_dispatcher_type="alltoall",
            # Per-sequence balance: a sum of per-sample terms, so the gradient does not depend on
            # how samples are grouped into microbatches or ranks (cells must match plain DP).
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=preset.moe_aux_loss_coeff,
        )
    return TransformerConfig(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        ffn_hidden_size=preset.ffn_hidden_size,
        kv_channels=preset.hidden_size // preset.num_attention_heads,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        **moe,
    )


def build_gpt(preset_name: str, layout: Layout = Layout(), seed: int = 1234) -> GPTModel:
    """Initialise Megatron's parallel state for `layout` and build this rank's GPTModel shard.

    torch.distributed must already be initialised (gloo on CPU); its world size must be a
    multiple of tp·pp·cp (and of ep for MoE).
    """
    preset = PRESETS[preset_name]
    if not torch.cuda.is_available():
        if preset.num_experts and layout.expert_tp > 1:
            raise ValueError("expert_tp > 1 needs unevenly sized all-gathers, which gloo does not support")
        apply_cpu_patches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        create_gloo_process_groups=False,  # the default groups already are gloo on CPU
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    config = transformer_config(preset, layout)
    spec = get_gpt_layer_local_spec(
        num_experts=preset.num_experts, qk_layernorm=True, normalization="RMSNorm"
    )
    if layout.cp > 1:  # Megatron's local attention refuses CP; ours gathers K/V over the CP group
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def wrap_for_training(
    model: GPTModel,
    lr: float = 1e-3,
    adam_eps: float = 1e-8,
    clip_grad: float = 1.0,
    distributed_optimizer: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0,
):
    """Megatron DDP (fp32 grad buffers) and its Adam optimizer; wires the schedule's grad hooks."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    ddp_model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, adam_eps=adam_eps, adam_beta1=betas[0], adam_beta2=betas[1],
            weight_decay=weight_decay, clip_grad=clip_grad,
            params_dtype=torch.float32, use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp_model],
        use_gloo_process_groups=False,
    )
    ddp_model.config.finalize_model_grads_func = finalize_model_grads
    ddp_model.config.no_sync_func = ddp_model.no_sync
    return ddp_model, optimizer


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


# ---- global names and TP sharding ---------------------------------------------------------

@dataclass(frozen=True)
class ShardInfo:
    """Where a local tensor sits in the full tensor: its TP slice along `dim` (Megatron's stride)."""

    tp_rank: int = 0
    tp_size: int = 1
    dim: int = 0
    stride: int = 1  # >1: the rank holds `stride` interleaved pieces (e.g. [gate_r; up_r] of SwiGLU fc1)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def _unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def global_names(model: GPTModel) -> dict[str, str]:
    """Local parameter name -> name in the unsplit model (global layer and expert indices)."""
    layer_offset = {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    names = {}
    for name, _ in model.named_parameters():
        global_name = _LAYER.sub(lambda m: f"decoder.layers.{layer_offset[m.group(1)]}.", name)
        match = _EXPERT.search(global_name)
        if match:
            experts = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
            expert = parallel_state.get_expert_model_parallel_rank() * experts + int(match.group(1))
            global_name = _EXPERT.sub(f".local_experts.{expert}.", global_name)
        names[name] = global_name
    return names


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


__all__ = [
    "GPTPreset", "PRESETS", "Layout", "ShardInfo", "StepResult", "transformer_config", "build_gpt",
    "wrap_for_training", "synthetic_microbatches", "global_names", "forward_backward", "train_step", "local_shards", "shard_of",
    "assemble_full", "load_full_state",
]
