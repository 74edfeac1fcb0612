"""The megatron engine's weights in the Hugging Face checkpoint layout of Qwen3 / Qwen3-MoE.

Rollout engines (transformers on the CPU, sglang on GPUs) run the policy as ``Qwen3ForCausalLM`` or
``Qwen3MoeForCausalLM`` and take its weights under HF checkpoint names. The presets are built to be
that architecture (RMSNorm, QK-norm over the head dim, SwiGLU, GQA, non-interleaved RoPE, no bias,
untied embeddings), and the conversion only re-lays tensors out:

* ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
  value head: it is split group by group into ``q_proj`` / ``k_proj`` / ``v_proj``;
* ``linear_fc1`` (dense and per expert) is ``[gate; up]``: it splits into ``gate_proj`` / ``up_proj``;
* the MoE router is ``mlp.gate``; Megatron's default routing (top-k over the logits, then a
  softmax over the chosen k) is HF's softmax over all experts, top-k and renormalise
  (``norm_topk_prob``); with ``moe_router_pre_softmax`` it is the same without renormalising.

`hf_config` derives the ``config.json`` from the Megatron config the engine builds (epsilon, RoPE
base, sizes) and refuses a Megatron setting the HF model cannot express. `to_hf` converts unsplit
tensors by global name (``model.global_names``) for a preset's name or any `GPTPreset` (that of an HF
checkpoint: ``hf_import`` is the way back); `gather_full_tensors` is the collective over one
replica's ranks that assembles them from TP / EP / PP shards.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist

from ftexp.engines.megatron.presets import PRESETS, GPTPreset

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_EXPERT_INDEX = re.compile(r"\.local_experts\.(\d+)\.")
# Megatron name (inside a layer) -> HF name (inside ``model.layers.{i}``) for the tensors that map 1:1.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def _megatron_config(preset_name: str):
    """The TransformerConfig the engine builds for `preset_name` (unsplit), checked to be Qwen3-shaped."""
    from ftexp.config import ModeConfig
    from ftexp.engines.megatron.model import transformer_config

    config = transformer_config(_preset(preset_name), ModeConfig(name="hf_export", num_cells=1))
    differences = {  # setting -> whether it differs from what the HF model computes
        "normalization": config.normalization != "RMSNorm",
        "qk_layernorm": not config.qk_layernorm,
        "gated_linear_unit": not config.gated_linear_unit,
        "activation_func": config.activation_func is not torch.nn.functional.silu,
        "rotary_interleaved": config.rotary_interleaved,  # HF rotates halves, not even/odd pairs
        "softmax_scale": config.softmax_scale is not None,  # HF scales by head_dim ** -0.5
        "layernorm_zero_centered_gamma": config.layernorm_zero_centered_gamma,
        "add_bias_linear": config.add_bias_linear,
        "add_qkv_bias": config.add_qkv_bias,
        "moe_router_score_function": config.moe_router_score_function != "softmax",
        "moe_router_group_topk": bool(config.moe_router_group_topk),
        "moe_router_topk_scaling_factor": bool(config.moe_router_topk_scaling_factor),
        "moe_router_enable_expert_bias": config.moe_router_enable_expert_bias,
        "moe_shared_expert_intermediate_size": bool(config.moe_shared_expert_intermediate_size),
    }
    if any(differences.values()):
        raise ValueError(f"preset {preset_name}: the Megatron model is not a Qwen3 model in "
                         f"{', '.join(k for k, v in differences.items() if v)}")
    return config


def _preset(preset: str | GPTPreset) -> GPTPreset:
    if isinstance(preset, GPTPreset):
        return preset
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r} (presets: {', '.join(PRESETS)})")
    return PRESETS[preset]


def hf_config(preset_name: str) -> dict:
    """``config.json`` of the HF model equal to `preset_name`'s Megatron GPT."""
    preset = _preset(preset_name)
    config = _megatron_config(preset_name)
    head_dim = config.kv_channels
    hf = {
        "architectures": ["Qwen3MoeForCausalLM" if preset.num_experts else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if preset.num_experts else "qwen3",
        "vocab_size": preset.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": preset.seq_length,  # GPTModel's max_sequence_length
        "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": preset.rotary_base,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": preset.tie_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
        "initializer_range": config.init_method_std,
        "use_cache": True,
        "torch_dtype": str(config.params_dtype).removeprefix("torch."),
    }
    if preset.num_experts:
        hf.update({
            "num_experts": preset.num_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "moe_intermediate_size": config.moe_ffn_hidden_size,
            # Megatron's pre-softmax routing weights by the unrenormalised probabilities.
            "norm_topk_prob": not config.moe_router_pre_softmax,
            "decoder_sparse_step": 1,  # every layer is MoE
            "mlp_only_layers": [],
            "router_aux_loss_coef": config.moe_aux_loss_coeff,
            "output_router_logits": False,
        })
    return hf


def write_hf_model_dir(preset_name: str, directory: str | Path,
                       weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` (and, given HF-named `weights`, ``model.safetensors``) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config(preset_name), indent=2) + "\n")
    if weights is not None:
        from safetensors.torch import save_file

        save_file({n: t.detach().cpu().contiguous() for n, t in weights.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    return directory


def to_hf(full_tensors: dict[str, torch.Tensor], preset: str | GPTPreset) -> dict[str, torch.Tensor]:
    """Unsplit Megatron tensors (global names) -> HF checkpoint tensors; any subset converts on its own."""
    model = _preset(preset)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full_tensors.items():
        if model.tie_embeddings and name == "output_layer.weight":
            continue  # the last pipeline stage's copy of the embedding: HF has the one tensor
        converted = _convert(name, tensor, model)
        if converted is None:
            raise ValueError(f"no HF name for Megatron tensor {name!r} (preset {preset})")
        out.update(converted)
    return out


def _convert(name: str, tensor: torch.Tensor, preset: GPTPreset) -> dict[str, torch.Tensor] | None:
    if name in _TOP_RENAMES:
        return {_TOP_RENAMES[name]: tensor}
    match = _LAYER.match(name)
    if match is None:
        return None
    prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in _LAYER_RENAMES:
        return {prefix + _LAYER_RENAMES[rest]: tensor}
    if rest == "self_attention.linear_qkv.weight":
        return {prefix + k: v for k, v in _split_qkv(name, tensor, preset).items()}
    if rest == "mlp.linear_fc1.weight":
        gate, up = _split_gate_up(name, tensor, preset.ffn_hidden_size)
        return {prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up}
    expert = _EXPERT.match(rest)
    if expert is None:
        return None
    index, which = expert.groups()
    expert_prefix = f"{prefix}mlp.experts.{index}."
    if which == "linear_fc2":
        return {expert_prefix + "down_proj.weight": tensor}
    gate, up = _split_gate_up(name, tensor, preset.ffn_hidden_size)
    return {expert_prefix + "gate_proj.weight": gate, expert_prefix + "up_proj.weight": up}


def _split_qkv(name: str, qkv: torch.Tensor, preset: GPTPreset) -> dict[str, torch.Tensor]:
    groups = preset.num_query_groups
    heads_per_group = preset.num_attention_heads // groups
    head_dim = preset.kv_channels
    rows = groups * (heads_per_group + 2) * head_dim
    if qkv.dim() != 2 or qkv.shape[0] != rows:
        raise ValueError(f"{name}: shape {tuple(qkv.shape)}, expected ({rows}, hidden) for "
                         f"{groups} groups of {heads_per_group} query heads + k + v of {head_dim}")
    per_group = qkv.reshape(groups, heads_per_group + 2, head_dim, qkv.shape[1])
    return {
        "self_attn.q_proj.weight": per_group[:, :heads_per_group].reshape(-1, qkv.shape[1]),
        "self_attn.k_proj.weight": per_group[:, heads_per_group].reshape(-1, qkv.shape[1]),
        "self_attn.v_proj.weight": per_group[:, heads_per_group + 1].reshape(-1, qkv.shape[1]),
    }


def _split_gate_up(name: str, fc1: torch.Tensor, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    if fc1.dim() != 2 or fc1.shape[0] != 2 * ffn:
        raise ValueError(f"{name}: shape {tuple(fc1.shape)}, expected ({2 * ffn}, hidden) = [gate; up]")
    return fc1[:ffn], fc1[ffn:]


# ---- the gather over one replica's ranks ----------------------------------------------------

def gather_full_tensors(module, global_names: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """Every rank of one replica calls this together; its first rank gets the unsplit tensors.

    `module` is this rank's GPTModel shard, `global_names` its ``model.global_names``. Shards are
    gathered in a fixed order of phases, each rank taking part in one group per phase, so no two
    ranks can wait on each other across groups: expert-TP, then EP (every rank: experts may sit on
    any TP, CP or even DP rank), then dense TP (CP rank 0 only, as CP ranks hold copies), then PP
    onto stage 0 (TP and CP rank 0 only). In a baseline world the ranks of DP replicas other than
    0 take part in the expert phases only. Every rank but the replica's first (dp = pp = tp = cp
    = 0) returns None.
    """
    from megatron.core import parallel_state as ps

    params = [(name, p) for name, p in module.named_parameters()]
    experts = [(name, p) for name, p in params if _EXPERT_INDEX.search(name)]
    dense = [(name, p) for name, p in params if not _EXPERT_INDEX.search(name)]

    full: dict[str, torch.Tensor] = {}
    expert_tensors = _gather_tp(experts, ps.get_expert_tensor_parallel_group())
    if experts:
        ep_size = ps.get_expert_model_parallel_world_size()
        per_ep_rank = _all_gather_flat(expert_tensors, ps.get_expert_model_parallel_group()) if ep_size > 1 \
            else [expert_tensors]
        local_experts = module.config.num_moe_experts // ep_size
        for rank, tensors in enumerate(per_ep_rank):
            for (name, _), tensor in zip(experts, tensors):
                index = rank * local_experts + int(_EXPERT_INDEX.search(name).group(1))
                full[_EXPERT_INDEX.sub(f".local_experts.{index}.", global_names[name])] = tensor

    if ps.get_data_parallel_rank() != 0 or ps.get_context_parallel_rank() != 0:
        return None
    full.update(zip((global_names[n] for n, _ in dense), _gather_tp(dense, ps.get_tensor_model_parallel_group())))
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    return _gather_stages(full, ps.get_pipeline_model_parallel_group())


def _gather_tp(params: list[tuple[str, torch.nn.Parameter]], group) -> list[torch.Tensor]:
    """Full tensors of `params` from their shards over the TP `group` (replicated ones as they are)."""
    local = [p.detach() for _, p in params]
    if dist.get_world_size(group) == 1 or not params:
        return local
    per_rank = _all_gather_flat(local, group)
    out = []
    for i, (_, p) in enumerate(params):
        if not getattr(p, "tensor_model_parallel", False):
            out.append(local[i])
            continue
        # A rank holds `stride` interleaved pieces (fc1: its [gate_r; up_r]); the full tensor
        # is every rank's first piece, then every rank's second, ...
        stride, dim = getattr(p, "partition_stride", 1), p.partition_dim
        pieces = [shards[i].chunk(stride, dim=dim) for shards in per_rank]
        out.append(torch.cat([pieces[r][s] for s in range(stride) for r in range(len(per_rank))], dim=dim))
    return out


def _all_gather_flat(tensors: list[torch.Tensor], group) -> list[list[torch.Tensor]]:
    """All-gather equally shaped lists of tensors over `group` in one collective: per rank, its list."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return [_unflatten(buffer, [(t.shape, t.dtype) for t in tensors]) for buffer in gathered]


def _unflatten(flat: torch.Tensor, layout: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape, _ in layout:
        count = shape.numel()
        out.append(flat[offset: offset + count].view(shape))
        offset += count
    return out


def _gather_stages(stage: dict[str, torch.Tensor], group) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's tensors onto stage 0: names and shapes as objects, values as one flat tensor per stage."""
    size = dist.get_world_size(group)
    if size == 1:
        return stage
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_group_rank(group, dist.get_rank())
    dtypes = {t.dtype for t in stage.values()}
    if len(dtypes) != 1:
        raise ValueError(f"parameters of one dtype expected, got {sorted(map(str, dtypes))}")
    layout = [(name, t.shape) for name, t in stage.items()]
    layouts = [None] * size if me == 0 else None
    dist.gather_object(layout, layouts, dst=ranks[0], group=group)
    if me != 0:
        dist.send(torch.cat([t.reshape(-1) for t in stage.values()]), dst=ranks[0], group=group)
        return None
    full = dict(stage)
    reference = next(iter(stage.values()))
    for source in range(1, size):
        names = [name for name, _ in layouts[source]]
        buffer = torch.empty(sum(shape.numel() for _, shape in layouts[source]), dtype=reference.dtype,
                             device=reference.device)
        dist.recv(buffer, src=ranks[source], group=group)
        full.update(zip(names, _unflatten(buffer, [(shape, reference.dtype) for _, shape in layouts[source]])))
    return full
