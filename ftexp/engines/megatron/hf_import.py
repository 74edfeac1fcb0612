"""A Hugging Face Qwen3 / Qwen3-MoE checkpoint as the megatron engine's policy: the way back from ``hf_export``.

The policy of a real run (``mode.hf_checkpoint``) is a local directory in the HF layout:
``config.json``, the weights as ``model.safetensors`` (or the shards ``model.safetensors.index.json``
lists) and ``tokenizer.json``. Only these files are read; nothing is ever downloaded.

* `HFCheckpoint.open` checks the directory and turns ``config.json`` into the engine's `GPTPreset`
  (layers, sizes, heads, query groups, head dim, experts and top-k, RoPE base, RMSNorm epsilon,
  vocabulary, context, tied embeddings), refusing in one line what the Megatron model the engine
  builds cannot express: another architecture, biases, scaled RoPE, sliding windows, dense layers
  between MoE layers. A missing file or weight is one line too, before anything launches.
* `load_shard` is ``hf_export`` read backwards. Every rank of a replica builds its shard of the
  model, then reads from the checkpoint only the tensors its own parameters are made of (its
  pipeline stage's layers, its EP rank's experts) and takes its TP part of each:
  ``q_proj`` / ``k_proj`` / ``v_proj`` interleave per query group into ``linear_qkv`` (the group's
  query heads, its key head, its value head), ``gate_proj`` / ``up_proj`` stack into ``linear_fc1``
  (dense and per expert), ``mlp.gate`` is the router, expert ``e`` of a layer becomes local expert
  ``e mod experts-per-rank`` of EP rank ``e div experts-per-rank``; with tied embeddings the last
  pipeline stage's output layer (a copy of the embedding when it is not the first stage) is
  ``embed_tokens`` too. Weights stored in another dtype (bf16) are cast to the model's fp32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ftexp.config import ModeConfig
# The names of hf_export, read the other way.
from ftexp.engines.megatron.hf_export import _EXPERT, _EXPERT_INDEX, _LAYER, _LAYER_RENAMES, _TOP_RENAMES
from ftexp.engines.megatron.presets import PRESETS, GPTPreset
from ftexp.errors import InputError

MODEL_TYPES = ("qwen3", "qwen3_moe")
WEIGHTS, WEIGHTS_INDEX, TOKENIZER = "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
SETTING = "mode.hf_checkpoint"  # where the path comes from, for every error line


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked checkpoint directory: its model, where each weight is stored, its tokenizer file."""

    path: Path
    weight_files: dict[str, Path]  # HF tensor name -> the safetensors file holding it
    preset: GPTPreset
    eos_token_id: int              # the end of an answer (the first one where config.json lists several)

    @property
    def tokenizer_file(self) -> Path:
        return self.path / TOKENIZER

    @classmethod
    def open(cls, path: str | Path) -> HFCheckpoint:
        """Check the directory; raise InputError (one line, naming the file) for anything missing or unsupported."""
        path = Path(path)
        if not path.is_dir():
            raise InputError(f"{SETTING}: {path} is not a directory" if path.exists()
                             else f"{SETTING}: {path} does not exist")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise InputError(f"{SETTING}: {config_path} does not exist (an HF checkpoint directory has config.json)")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"{SETTING}: {config_path} is not readable JSON ({e})") from None
        if not isinstance(config, dict):
            raise InputError(f"{SETTING}: {config_path} is not a JSON object")
        preset = preset_from_config(config, config_path)
        eos = config.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if not isinstance(eos, int):
            raise InputError(f"{SETTING}: {config_path} has no eos_token_id (a task's answers end at it)")
        if not (path / TOKENIZER).is_file():
            raise InputError(f"{SETTING}: {path / TOKENIZER} does not exist (the policy's tokenizer)")
        weight_files = checkpoint_weight_files(path)
        missing = [n for n in expected_weight_names(preset) if n not in weight_files]
        if missing:
            raise InputError(f"{SETTING}: {path}: {len(missing)} weight(s) of the {config['model_type']} model missing "
                             f"from the safetensors files, e.g. {missing[0]}")
        return cls(path=path, weight_files=weight_files, preset=preset, eos_token_id=eos)


def model_preset(mode: ModeConfig) -> GPTPreset:
    """The mode's model: its HF checkpoint's when ``mode.hf_checkpoint`` is set, else the named preset."""
    if mode.hf_checkpoint:
        return open_checkpoint(mode.hf_checkpoint).preset
    preset = PRESETS.get(mode.model_preset)
    if preset is None:
        raise InputError(f"mode {mode.name}: unknown model_preset {mode.model_preset!r} (presets: {', '.join(PRESETS)})")
    return preset


@lru_cache(maxsize=4)
def open_checkpoint(path: str) -> HFCheckpoint:
    """`HFCheckpoint.open`, once per process and path (validation, every engine method and rank ask again)."""
    return HFCheckpoint.open(path)


def preset_from_config(config: dict, where: Path) -> GPTPreset:
    """The `GPTPreset` of the Megatron model equal to the HF model `config` describes (`where`: for errors)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise InputError(f"{SETTING}: {where}: model_type {model_type!r} is not one the megatron engine builds "
                         f"({' or '.join(MODEL_TYPES)})")
    moe = model_type == "qwen3_moe"
    sizes = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
             "moe_intermediate_size" if moe else "intermediate_size"]
    absent = [key for key in sizes if not isinstance(config.get(key), int)]
    if absent:
        raise InputError(f"{SETTING}: {where}: no integer {', '.join(absent)}")
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    experts = config.get("num_experts", config.get("num_local_experts")) if moe else None
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    unsupported = {  # setting -> whether the Megatron model computes something else
        f"hidden_act={config.get('hidden_act')}": config.get("hidden_act", "silu") != "silu",
        "attention_bias=true": bool(config.get("attention_bias")),
        "use_sliding_window=true": bool(config.get("use_sliding_window")),
        "layer_types other than full_attention": any(t != "full_attention" for t in config.get("layer_types") or []),
        f"rope_scaling={config.get('rope_scaling')}": config.get("rope_scaling") is not None,
        f"rope_type={rope.get('rope_type')}": rope.get("rope_type", "default") != "default",
        f"{heads} attention heads in {groups} key/value groups": heads % groups != 0,
        f"num_experts={experts}": moe and not (isinstance(experts, int) and experts > 0),
        "dense layers between MoE layers (decoder_sparse_step, mlp_only_layers)":
            moe and (config.get("decoder_sparse_step", 1) != 1 or bool(config.get("mlp_only_layers"))),
    }
    if any(unsupported.values()):
        raise InputError(f"{SETTING}: {where}: the megatron engine cannot express "
                         f"{', '.join(k for k, v in unsupported.items() if v)}")
    return GPTPreset(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=config["moe_intermediate_size" if moe else "intermediate_size"],
        vocab_size=config["vocab_size"],
        seq_length=config["max_position_embeddings"],
        num_experts=experts,
        moe_router_topk=config.get("num_experts_per_tok", 2) if moe else 2,
        moe_aux_loss_coeff=config.get("router_aux_loss_coef", 0.0) if moe else 0.0,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rotary_base=float(rope.get("rope_theta", 10000.0)),
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        moe_router_pre_softmax=moe and not config.get("norm_topk_prob", False),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def has_weights(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS_INDEX).is_file() or (Path(path) / WEIGHTS).is_file()


def checkpoint_weight_files(path: str | Path) -> dict[str, Path]:
    """HF tensor name -> its safetensors file: from the shard index, else the single file's header."""
    path = Path(path)
    index = path / WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{SETTING}: {index} has no readable weight_map ({e})") from None
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise InputError(f"{SETTING}: {absent[0]} does not exist ({len(absent)} of the shards {index.name} lists)")
        return files
    single = path / WEIGHTS
    if not single.is_file():
        raise InputError(f"{SETTING}: {path} has no weights ({WEIGHTS} or {WEIGHTS_INDEX}; only safetensors are read)")
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise InputError(f"{SETTING}: {single} is not a safetensors file ({e})") from None


def expected_weight_names(preset: GPTPreset) -> list[str]:
    """Every HF tensor name of the model `preset` describes (what ``hf_export.to_hf`` produces)."""
    tied = {"output_layer.weight"} if preset.tie_embeddings else set()  # lm_head is embed_tokens
    names = [hf for megatron, hf in _TOP_RENAMES.items() if megatron not in tied]
    for layer in range(preset.num_layers):
        prefix = f"model.layers.{layer}."
        not_in_this_model = "mlp.linear_fc2.weight" if preset.num_experts else "mlp.router.weight"
        names += [prefix + hf for megatron, hf in _LAYER_RENAMES.items() if megatron != not_in_this_model]
        names += [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
        if preset.num_experts:
            names += [f"{prefix}mlp.experts.{e}.{p}_proj.weight" for e in range(preset.num_experts)
                      for p in ("gate", "up", "down")]
        else:
            names += [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    return names


def read_tensors(weight_files: dict[str, Path], names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors `names` (None: all), each file opened once."""
    from safetensors import safe_open

    wanted = list(weight_files) if names is None else names
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(weight_files[name], []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in file_names})
    return out


# ---- HF tensors -> Megatron tensors ---------------------------------------------------------

def hf_names_of(name: str, preset: GPTPreset) -> list[str]:
    """The HF tensors Megatron tensor `name` (a global name) is made of, in the order it stacks them."""
    if preset.tie_embeddings and name == "output_layer.weight":
        return [_TOP_RENAMES["embedding.word_embeddings.weight"]]
    if name in _TOP_RENAMES:
        return [_TOP_RENAMES[name]]
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"no HF tensor for Megatron tensor {name!r}")
    prefix, rest = f"model.layers.{match.group(1)}.", match.group(2)
    if rest in _LAYER_RENAMES:
        return [prefix + _LAYER_RENAMES[rest]]
    if rest == "self_attention.linear_qkv.weight":
        return [prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
    if rest == "mlp.linear_fc1.weight":
        return [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]
    expert = _EXPERT.match(rest)
    if expert is None:
        raise ValueError(f"no HF tensor for Megatron tensor {name!r}")
    index, which = expert.groups()
    expert_prefix = f"{prefix}mlp.experts.{index}."
    if which == "linear_fc2":
        return [expert_prefix + "down_proj.weight"]
    return [expert_prefix + "gate_proj.weight", expert_prefix + "up_proj.weight"]


def to_megatron(name: str, hf: list[torch.Tensor], preset: GPTPreset) -> torch.Tensor:
    """The unsplit Megatron tensor `name` from its HF tensors (`hf_names_of` order)."""
    if len(hf) == 3:  # q, k, v -> per query group: its query heads, its key head, its value head
        q, k, v = hf
        groups, head_dim, hidden = preset.num_query_groups, preset.kv_channels, q.shape[-1]
        return torch.cat([q.reshape(groups, -1, hidden), k.reshape(groups, head_dim, hidden),
                          v.reshape(groups, head_dim, hidden)], dim=1).reshape(-1, hidden)
    return torch.cat(hf) if len(hf) == 2 else hf[0]  # [gate; up], or a 1:1 tensor


def tp_shard(param: torch.nn.Parameter, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This TP rank's part of `full`: the inverse of ``hf_export._gather_tp``.

    A rank holds ``partition_stride`` interleaved pieces: of the full tensor cut into stride × world
    chunks along ``partition_dim``, chunks ``rank``, ``world + rank``, ... (fc1: its [gate_r; up_r]).
    """
    if world == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
    chunks = full.chunk(stride * world, dim=dim)
    return torch.cat([chunks[s * world + rank] for s in range(stride)], dim=dim)


def load_shard(module, global_names: dict[str, str], checkpoint: HFCheckpoint) -> None:
    """Every rank of a replica calls this (no collective): its shard of `module` takes the checkpoint's weights.

    `module` is this rank's GPTModel shard, `global_names` its ``model.global_names``; the shapes are
    checked before anything is written.
    """
    from megatron.core import parallel_state as ps

    dense = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    expert = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    params = list(module.named_parameters())
    sources = {name: hf_names_of(global_names[name], checkpoint.preset) for name, _ in params}
    hf = read_tensors(checkpoint.weight_files, sorted({n for names in sources.values() for n in names}))
    shards = {}
    for name, param in params:
        full = to_megatron(global_names[name], [hf[n] for n in sources[name]], checkpoint.preset)
        rank, world = expert if _EXPERT_INDEX.search(name) else dense
        shard = tp_shard(param, full, rank, world)
        if shard.shape != param.shape:
            raise InputError(f"{SETTING}: {checkpoint.path}: {', '.join(sources[name])}: shape {tuple(full.shape)} "
                             f"does not make Megatron's {global_names[name]} of {tuple(param.shape)} per rank")
        shards[name] = shard
    with torch.no_grad():
        for name, param in params:
            param.copy_(shards[name])
