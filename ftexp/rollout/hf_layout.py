"""A rollout engine's model: a transformers model whose weights are addressed by HF checkpoint names.

Weight updates arrive one tensor at a time under the names a checkpoint (and sglang) uses, e.g.
``model.layers.0.mlp.experts.3.gate_proj.weight``. transformers 5 keeps a MoE layer's experts fused
in two parameters, ``mlp.experts.gate_up_proj`` [experts, 2·intermediate, hidden] (expert e's gate
rows, then its up rows) and ``mlp.experts.down_proj`` [experts, hidden, intermediate]; a
per-expert checkpoint tensor is a slice of one of them. Every other checkpoint name is a parameter
name of the model. `load_hf_weights` writes named tensors into place, `hf_state_dict` reads them
back under the same names (so an engine can checksum per checkpoint name).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ftexp.errors import InputError

_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def build_model(model_dir: str | Path):
    """The transformers causal LM that ``model_dir/config.json`` describes: fp32, eval mode, never online.

    Its weights are freshly initialised; `load_hf_weights` sets them.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise InputError(f"no model config at {config_path}")
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _fused_experts(model) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """``…mlp.experts`` prefix -> its fused (gate_up_proj, down_proj) parameters."""
    params = dict(model.named_parameters())
    return {name.removesuffix(".gate_up_proj"): (p, params[name.removesuffix("gate_up_proj") + "down_proj"])
            for name, p in params.items() if name.endswith(".mlp.experts.gate_up_proj")}


def _target(name: str, params: dict[str, torch.nn.Parameter], fused: dict, model) -> torch.Tensor:
    """The view of the model's storage that checkpoint tensor `name` is."""
    if name in params and name.rsplit(".", 1)[0] not in fused:  # a fused parameter is not a checkpoint name
        return params[name]
    match = _EXPERT.match(name)
    if match and match["experts"] in fused:
        gate_up, down = fused[match["experts"]]
        index = int(match["index"])
        if index < gate_up.shape[0]:
            if match["proj"] == "down_proj":
                return down[index]
            intermediate = gate_up.shape[1] // 2
            return gate_up[index, :intermediate] if match["proj"] == "gate_proj" else gate_up[index, intermediate:]
    raise InputError(f"unknown weight name {name!r} for {type(model).__name__}")


def load_hf_weights(model, named: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint-named tensors into `model`; any subset, e.g. one tensor per update message.

    Every name and shape is checked before anything is written, so a bad message changes nothing.
    """
    params = dict(model.named_parameters())
    fused = _fused_experts(model)
    targets = {}
    for name, tensor in named.items():
        target = _target(name, params, fused, model)
        if tuple(tensor.shape) != tuple(target.shape):
            raise InputError(f"weight {name}: shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}")
        targets[name] = target
    with torch.no_grad():
        for name, tensor in named.items():
            targets[name].copy_(tensor)


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names (fused experts split per expert); views, not copies."""
    fused = _fused_experts(model)
    out = {}
    for name, p in model.named_parameters():
        experts = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        if experts not in fused:
            out[name] = p.detach()
            continue
        if name.endswith(".down_proj"):
            for index in range(p.shape[0]):
                out[f"{experts}.{index}.down_proj.weight"] = p.detach()[index]
        else:
            intermediate = p.shape[1] // 2
            for index in range(p.shape[0]):
                out[f"{experts}.{index}.gate_proj.weight"] = p.detach()[index, :intermediate]
                out[f"{experts}.{index}.up_proj.weight"] = p.detach()[index, intermediate:]
    return out
