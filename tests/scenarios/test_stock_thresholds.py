"""The stock dump rules (conf/threshold/*.yaml) on the tensor names each engine really dumps.

Every rule must be the first match of some tensor on every model it applies to, so a typo'd or
shadowed pattern turns the verdict red instead of silently judging nothing.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from ftexp.audit.dumps import write_dump
from ftexp.config import Engine, ModelConfig, ThresholdConfig
from ftexp.engines.torch.model import build_model
from ftexp.errors import InputError
from ftexp.engines.registry import MODEL_FEATURES, get_engine
from ftexp.validate import validate_thresholds
from ftexp.verify.dumps import compare_dumps

CONF = Path(__file__).resolve().parents[2] / "conf" / "threshold"
STOCK = sorted(p.stem for p in CONF.glob("*.yaml"))

# One layer of each megatron preset as the engine dumps it (``global_names`` of
# ``engines/megatron/model.py``: printed from build_gpt on a one-rank world), plus the shared ends.
_MEGATRON_LAYER = ["input_layernorm.weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight",
                   "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight", "pre_mlp_layernorm.weight"]
_ENDS = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
MEGATRON_DENSE = _ENDS + [f"decoder.layers.0.{n}" for n in _MEGATRON_LAYER + ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]]
MEGATRON_MOE = _ENDS + [f"decoder.layers.0.{n}" for n in _MEGATRON_LAYER + ["mlp.router.weight"] + [
    f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(4) for i in (1, 2)]]


def torch_names() -> list[str]:
    model = build_model(ModelConfig())
    return [n for n, _ in model.named_parameters() if "witness" not in n]


MODELS = {  # model -> (engine, preset)
    "torch": (Engine.torch, "tiny_dense"),
    "megatron_dense": (Engine.megatron, "tiny_dense"),
    "megatron_moe": (Engine.megatron, "tiny_moe_5layer"),
}


def names_of(model: str) -> list[str]:
    return {"torch": torch_names, "megatron_dense": lambda: MEGATRON_DENSE, "megatron_moe": lambda: MEGATRON_MOE}[model]()


def features_of(model: str) -> frozenset[str]:
    engine, preset = MODELS[model]
    return get_engine(engine).model_features(SimpleNamespace(model_preset=preset, hf_checkpoint=None))


def stock_rules(name: str, key: str = "dumps") -> list[tuple]:
    return [tuple(r) for r in yaml.safe_load((CONF / f"{name}.yaml").read_text()).get(key, [])]


def tree(root: Path, names: list[str], rank: int) -> Path:
    for i, name in enumerate(f"{p}__{n}" for p in ("weight", "grad") for n in names):
        write_dump(root / "fwd_bwd/rollout_0", name, torch.ones(2), step=0, rank=rank, dump_index=i, pp=0, tp=0)
    return root


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    return {m: (tree(root / m / "b", names_of(m), 0), tree(root / m / "t", names_of(m), 1)) for m in MODELS}


def test_model_features_follow_engine_and_preset():
    assert features_of("torch") == frozenset()
    assert features_of("megatron_dense") == {"qk_norm"}
    assert features_of("megatron_moe") == {"moe", "qk_norm"}
    assert all(f in MODEL_FEATURES for m in MODELS for f in features_of(m))


@pytest.mark.parametrize("threshold, key", [(t, k) for t in STOCK for k in ("dumps", "fp32_dumps") if stock_rules(t, k)])
@pytest.mark.parametrize("model", MODELS)
def test_no_stock_rule_is_dead_on_any_model(trees, threshold, key, model):
    rules = stock_rules(threshold, key)
    result = compare_dumps(*trees[model], rules, model_features=features_of(model))
    assert result.passed, result.issues
    for usage in result.rules:  # a rule is skipped only for a feature the model lacks
        assert usage["status"] == "live" or (usage["status"] == "not applicable"
                                             and usage["feature"] not in features_of(model)), usage


def test_with_failure_floors_judge_the_megatron_expert_and_qk_norm_grads(trees):
    result = compare_dumps(*trees["megatron_moe"], stock_rules("with_failure"), model_features=features_of("megatron_moe"))
    assert [(u["feature"], u["first_match_of"]) for u in result.rules] == [("moe", 8), ("qk_norm", 2), (None, 26)]
    torch_result = compare_dumps(*trees["torch"], stock_rules("with_failure"))
    assert [u["status"] for u in torch_result.rules] == ["not applicable", "not applicable", "live"]


@pytest.mark.parametrize("typo", [r"grad__.*\.mlp\.expert\..*", r"grad__.*\.mlp\.experts\.", r"grad__.*\.qk_layernorm\..*"])
def test_a_typo_in_a_stock_feature_rule_is_caught_on_the_model_it_is_for(trees, typo):
    rules = stock_rules("with_failure")
    i = 0 if "expert" in typo else 1
    rules[i] = (typo, *rules[i][1:])
    result = compare_dumps(*trees["megatron_moe"], rules, model_features=features_of("megatron_moe"))
    assert not result.passed
    assert result.issues == [f"threshold rule #{i} {typo!r} -> {rules[i][1]!r} (for models with {rules[i][2]}) "
                             f"is the first match of no tensor: a dead rule (a typo'd pattern, or one shadowed by an earlier rule)"]


def threshold_cfg(dumps, fp32_dumps=()):
    return SimpleNamespace(threshold=ThresholdConfig(name="t", dumps=[list(r) for r in dumps],
                                                     fp32_dumps=[list(r) for r in fp32_dumps], metrics=[]))


def test_validate_accepts_the_stock_rules_and_refuses_unknown_features():
    for name in STOCK:
        validate_thresholds(threshold_cfg(stock_rules(name), stock_rules(name, "fp32_dumps")))
    with pytest.raises(InputError, match="unknown model feature 'experts' \\(known: moe, qk_norm\\)"):
        validate_thresholds(threshold_cfg([(".*experts.*", "rel <= 0.0085", "experts"), (".*", "rel <= 0.0085")]))
    with pytest.raises(InputError, match="threshold.fp32_dumps"):
        validate_thresholds(threshold_cfg([(".*", "1")], [(".*", "rel <= 1e-6", "moee")]))
