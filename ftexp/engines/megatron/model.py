"""Tiny megatron-core GPT models with TP / SP / PP / CP / EP, trainable on CPU with gloo.

`build_gpt` sets up Megatron's parallel state for a mode's layout (``ftexp.config.ModeConfig``)
and builds the local shard of a GPTModel from a preset (local layer spec, fp32, no dropout, CPU
initialisation; a preset's name, or the `GPTPreset` of an HF checkpoint); `wrap_for_training` adds Megatron's DDP and optimizer (Adam). Every parameter
has a global name (`global_names`: layer and expert indices as in the unsplit model).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ftexp.engines.megatron.cpu_compat import apply_cpu_patches, lean_import
from ftexp.engines.megatron.presets import PRESETS, GPTPreset

with lean_import():  # the first import of megatron-core in a process (see lean_import)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

from ftexp.engines.megatron.cp_attention import ContextParallelAttention

if TYPE_CHECKING:
    from ftexp.config import ModeConfig


def transformer_config(preset: GPTPreset, mode: ModeConfig) -> TransformerConfig:
    """`preset` split over one replica as `mode` says; the rest of the world is data parallel."""
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
            moe_router_pre_softmax=preset.moe_router_pre_softmax,
        )
    return TransformerConfig(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        ffn_hidden_size=preset.ffn_hidden_size,
        kv_channels=preset.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=preset.layernorm_epsilon,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        tensor_model_parallel_size=mode.tp,
        pipeline_model_parallel_size=mode.pp,
        context_parallel_size=mode.cp,
        expert_model_parallel_size=mode.ep,
        expert_tensor_parallel_size=mode.etp,
        sequence_parallel=mode.sequence_parallel,
        num_layers_in_first_pipeline_stage=mode.decoder_first_pipeline_num_layers,  # uneven pipeline split
        num_layers_in_last_pipeline_stage=mode.decoder_last_pipeline_num_layers,
        **moe,
    )


def build_gpt(preset: str | GPTPreset, mode: ModeConfig, seed: int = 1234) -> GPTModel:
    """Initialise Megatron's parallel state for `mode`'s layout and build this rank's GPTModel shard.

    torch.distributed must already be initialised (gloo on CPU); its world size must be a
    multiple of tp·pp·cp (``mode.ranks_per_cell``; and of ep for MoE).
    """
    if isinstance(preset, str):
        preset = PRESETS[preset]
    if not torch.cuda.is_available():
        apply_cpu_patches()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=mode.tp,
        pipeline_model_parallel_size=mode.pp,
        context_parallel_size=mode.cp,
        expert_model_parallel_size=mode.ep,
        expert_tensor_parallel_size=mode.etp,
        create_gloo_process_groups=False,  # the default groups already are gloo on CPU
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    config = transformer_config(preset, mode)
    spec = get_gpt_layer_local_spec(
        num_experts=preset.num_experts, qk_layernorm=True, normalization="RMSNorm"
    )
    if mode.cp > 1:  # Megatron's local attention refuses CP; ours gathers K/V over the CP group
        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=preset.vocab_size,
        max_sequence_length=preset.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=preset.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=preset.rotary_base,
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


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


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
