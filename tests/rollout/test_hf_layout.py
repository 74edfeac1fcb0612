"""Checkpoint-named weights in and out of a transformers Qwen3 / Qwen3-MoE model, one tensor at a time.

transformers' own checkpoint loader (``from_pretrained`` on a safetensors file) is the reference for
where a per-expert tensor goes in its fused expert parameters.
"""

import json

import pytest
import torch

from ftexp.errors import InputError
from ftexp.rollout.hf_layout import build_model, hf_state_dict, load_hf_weights

COMMON = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=4, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, torch_dtype="float32")
CONFIGS = {
    "qwen3": dict(COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3_moe": dict(COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=3,
                      num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def _model_dir(tmp_path, kind):
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[kind]))
    return tmp_path


def _random_like(named: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) for name, t in named.items()}


@pytest.mark.parametrize("kind", CONFIGS)
def test_loaded_weights_sit_where_transformers_own_loader_puts_them(kind, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = build_model(_model_dir(tmp_path, kind))
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    weights = _random_like(hf_state_dict(model))
    if kind == "qwen3_moe":
        assert "model.layers.1.mlp.experts.2.up_proj.weight" in weights  # per-expert checkpoint names
    load_hf_weights(model, weights)

    save_file(weights, str(tmp_path / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, local_files_only=True)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    differing = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    assert differing == []


@pytest.mark.parametrize("kind", CONFIGS)
def test_tensor_by_tensor_round_trip(kind, tmp_path):
    model = build_model(_model_dir(tmp_path, kind))
    weights = _random_like(hf_state_dict(model), seed=1)
    for name, tensor in weights.items():  # as updates arrive: one name per message
        load_hf_weights(model, {name: tensor})
    back = hf_state_dict(model)
    assert back.keys() == weights.keys()
    assert [n for n in weights if not torch.equal(back[n], weights[n])] == []


def test_unknown_name_or_wrong_shape_is_refused_and_writes_nothing(tmp_path):
    model = build_model(_model_dir(tmp_path, "qwen3_moe"))
    before = {n: t.clone() for n, t in hf_state_dict(model).items()}
    good = {"model.norm.weight": torch.full((16,), 7.0)}
    for bad, message in [
        ({"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 16)}, "unknown weight name"),  # no dense MLP here
        ({"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(16, 8)}, "unknown weight name"),  # 3 experts
        ({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(3, 16, 16)}, "unknown weight name"),  # fused
        ({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 16)}, "shape"),
        ({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(16, 8)}, "shape"),  # transposed
    ]:
        with pytest.raises(InputError, match=message):
            load_hf_weights(model, {**good, **bad})
    after = hf_state_dict(model)
    assert [n for n in before if not torch.equal(before[n], after[n])] == []
    load_hf_weights(model, good)
    assert torch.equal(hf_state_dict(model)["model.norm.weight"], good["model.norm.weight"])


def test_build_model_needs_a_config(tmp_path):
    with pytest.raises(InputError, match="no model config"):
        build_model(tmp_path)
