"""Megatron → HF conversion: the transformers Qwen3 model given the converted weights is the same function.

A one-rank Megatron replica of each preset (norm weights scrambled, so a misplaced norm shows)
computes logits for fixed tokens; its weights go through `MegatronReplica.export_hf` into a
transformers model built from `hf_config`, which must give the same logits, as must the checkpoint
directory `write_hf_model_dir` writes, loaded by transformers' own ``from_pretrained``. Planted
conversion bugs must not. Multi-rank replicas (TP, SP, PP, EP, CP, and a baseline's DP) loaded with the same
full weights must export exactly the one-rank tensors.
"""

import time

import pytest
import torch
from loopback_world import join_world, rendezvous_port, spawn_ranks
from megatron_harness import _quiet_expected_warnings

from ftexp.config import Engine, MegatronConfig, ModeConfig, RolloutConfig, TrainerConfig
from ftexp.engines.megatron.hf_export import hf_config, to_hf, write_hf_model_dir
from ftexp.rollout.hf_layout import build_model, hf_state_dict, load_hf_weights

DENSE, MOE = "tiny_dense", "tiny_moe_5layer"
TOKENS_SHAPE = (2, 24)  # a rollout's prompt + response length
LOGIT_ATOL = 1e-5


def _replica(preset: str, mode: ModeConfig):
    from ftexp.engines.megatron.replica import MegatronReplica

    cfg = TrainerConfig(engine=Engine.megatron, rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
                        megatron=MegatronConfig(micro_batch_size=2))
    return MegatronReplica(cfg, mode, seed=1)


def _init_world(rank: int, world: int, port: int) -> None:
    _quiet_expected_warnings()
    torch.set_num_threads(1)
    join_world(rank, world, port)


def _one_rank_worker(rank, port, out_path):
    import torch.distributed as dist

    _init_world(rank, 1, port)
    out = {}
    for preset in (DENSE, MOE):
        replica = _replica(preset, ModeConfig(name="one_rank", num_cells=1, model_preset=preset,
                                              engines=[Engine.megatron]))
        module = replica.module
        seeded = replica.export_hf()
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # norms start at 1: make them differ, so a swapped norm changes the logits
            for name, p in module.named_parameters():
                if "layernorm" in name:
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
        tokens = torch.randint(0, module.vocab_size, TOKENS_SHAPE, generator=generator)
        module.eval()
        with torch.no_grad():
            logits = module(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                            attention_mask=None)
        start = time.perf_counter()
        hf = replica.export_hf()
        out[preset] = dict(
            full={replica.global_names[n]: p.detach().clone() for n, p in module.named_parameters()},
            hf=hf, seeded=seeded, export_s=time.perf_counter() - start, tokens=tokens, logits=logits,
            layernorm_epsilon=module.config.layernorm_epsilon, rotary_base=module.rotary_base,
            inv_freq=module.rotary_pos_emb.inv_freq.clone(),
        )
    torch.save(out, out_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_export") / "one_rank.pt"
    spawn_ranks(_one_rank_worker, args=(rendezvous_port(), str(out)), nprocs=1)
    return torch.load(out, weights_only=False)


def _hf_logits(preset: str, weights: dict[str, torch.Tensor], tmp_path, tokens: torch.Tensor) -> torch.Tensor:
    model = build_model(write_hf_model_dir(preset, tmp_path / preset))
    assert set(hf_state_dict(model)) == set(weights)  # the export names every checkpoint tensor, nothing else
    load_hf_weights(model, weights)
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.slow
@pytest.mark.parametrize("preset", [DENSE, MOE])
def test_hf_model_gives_megatrons_logits(one_rank, preset, tmp_path):
    run = one_rank[preset]
    assert run["hf"].keys() == to_hf(run["full"], preset).keys()
    logits = _hf_logits(preset, run["hf"], tmp_path, run["tokens"])
    diff = (logits - run["logits"]).abs().max().item()
    print(f"{preset}: max |HF - Megatron| logit = {diff:.2e} (logits ~{run['logits'].abs().max():.2f}); "
          f"export_hf {run['export_s'] * 1e3:.1f} ms")
    assert diff <= LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("preset", [DENSE, MOE])
def test_written_checkpoint_dir_loads_with_transformers_own_loader(one_rank, preset, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = one_rank[preset]
    directory = write_hf_model_dir(preset, tmp_path / "checkpoint", weights=run["hf"])
    model = AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids=run["tokens"]).logits
    assert (logits - run["logits"]).abs().max().item() <= LOGIT_ATOL


def _transpose(weights, name):
    weights[name] = weights[name].t().contiguous()


def _swap(weights, a, b):
    weights[a], weights[b] = weights[b], weights[a]


PLANTED = {  # a conversion bug -> what it does to the HF-named tensors
    "o_proj transposed": lambda w: _transpose(w, "model.layers.1.self_attn.o_proj.weight"),
    "k and v swapped": lambda w: _swap(w, "model.layers.0.self_attn.k_proj.weight",
                                       "model.layers.0.self_attn.v_proj.weight"),
    "q_norm and k_norm swapped": lambda w: _swap(w, "model.layers.2.self_attn.q_norm.weight",
                                                 "model.layers.2.self_attn.k_norm.weight"),
    "the two layer norms swapped": lambda w: _swap(w, "model.layers.0.input_layernorm.weight",
                                                   "model.layers.0.post_attention_layernorm.weight"),
    "query heads out of group order": lambda w: w.update({
        "model.layers.0.self_attn.q_proj.weight": w["model.layers.0.self_attn.q_proj.weight"].roll(16, dims=0)}),
}
PLANTED_MOE = {
    "an expert's gate and up swapped": lambda w: _swap(w, "model.layers.3.mlp.experts.1.gate_proj.weight",
                                                       "model.layers.3.mlp.experts.1.up_proj.weight"),
    "experts renumbered": lambda w: _swap(w, "model.layers.4.mlp.experts.0.down_proj.weight",
                                          "model.layers.4.mlp.experts.2.down_proj.weight"),
}
PLANTED_DENSE = {
    "gate and up swapped": lambda w: _swap(w, "model.layers.3.mlp.gate_proj.weight", "model.layers.3.mlp.up_proj.weight"),
}


@pytest.mark.slow
@pytest.mark.parametrize("preset, bug", [(p, b) for p in (DENSE, MOE) for b in PLANTED]
                         + [(MOE, b) for b in PLANTED_MOE] + [(DENSE, b) for b in PLANTED_DENSE])
def test_a_planted_conversion_bug_changes_the_logits(one_rank, preset, bug, tmp_path):
    run = one_rank[preset]
    weights = dict(run["hf"])
    {**PLANTED, **PLANTED_MOE, **PLANTED_DENSE}[bug](weights)
    diff = (_hf_logits(preset, weights, tmp_path, run["tokens"]) - run["logits"]).abs().max().item()
    assert diff > 100 * LOGIT_ATOL, f"{bug}: logits still agree ({diff:.1e})"


@pytest.mark.slow
@pytest.mark.parametrize("preset", [DENSE, MOE])
def test_hf_config_takes_megatrons_numeric_conventions(one_rank, preset):
    run, config = one_rank[preset], hf_config(preset)
    assert config["rms_norm_eps"] == run["layernorm_epsilon"]
    assert config["rope_theta"] == run["rotary_base"]
    head_dim = config["head_dim"]
    hf_inv_freq = 1.0 / config["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    torch.testing.assert_close(run["inv_freq"], hf_inv_freq)  # RoPE over the whole head dim, the same frequencies
    assert config["model_type"] == ("qwen3_moe" if preset == MOE else "qwen3")
    assert config["tie_word_embeddings"] is False


def test_to_hf_refuses_an_unknown_or_misshapen_tensor():
    with pytest.raises(ValueError, match="no HF name"):
        to_hf({"decoder.layers.0.mlp.linear_fc3.weight": torch.zeros(2, 2)}, DENSE)
    with pytest.raises(ValueError, match="linear_qkv"):
        to_hf({"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(96, 64)}, DENSE)
    with pytest.raises(ValueError, match="unknown model preset"):
        to_hf({}, "no_such_preset")


# ---- the gather over a multi-rank replica -----------------------------------------------------

def _multi_rank_worker(rank, world, port, preset, mode, full_path, out_dir):
    import torch.distributed as dist
    from megatron_training import load_full_state

    _init_world(rank, world, port)
    replica = _replica(preset, mode)
    seeded = replica.export_hf()  # the layout's own initialisation from the same seed
    load_full_state(replica.module, torch.load(full_path))
    start = time.perf_counter()
    loaded = replica.export_hf()
    torch.save(dict(seeded=seeded, loaded=loaded, export_s=time.perf_counter() - start), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


MULTI_RANK = [  # preset, layout, world (> ranks of a replica: the rest is data parallel)
    pytest.param(MOE, ModeConfig(name="tp2_pp2_ep2_sp", num_cells=1, tp=2, pp=2, ep=2, sequence_parallel=True,
                                 decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=2,
                                 model_preset=MOE), 4, id="moe_tp2_pp2_ep2_sp"),
    pytest.param(MOE, ModeConfig(name="cp2_ep2", num_cells=1, cp=2, ep=2, model_preset=MOE), 2, id="moe_cp2_ep2"),
    pytest.param(DENSE, ModeConfig(name="tp2_dp2", num_cells=2, tp=2, model_preset=DENSE), 4, id="dense_tp2_dp2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset, mode, world", MULTI_RANK)
def test_multi_rank_export_equals_the_one_rank_model(one_rank, preset, mode, world, tmp_path):
    run = one_rank[preset]
    torch.save(run["full"], tmp_path / "full.pt")
    spawn_ranks(_multi_rank_worker, nprocs=world,
                args=(world, rendezvous_port(), preset, mode, str(tmp_path / "full.pt"), str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(r["loaded"] is None and r["seeded"] is None for r in ranks[1:])  # only the first rank holds it
    got, want = ranks[0]["loaded"], run["hf"]
    assert got.keys() == want.keys()
    differing = [name for name in want if not torch.equal(got[name], want[name])]
    assert differing == []
    seeded_equal = sum(torch.equal(ranks[0]["seeded"][n], run["seeded"][n]) for n in want)
    print(f"{mode.name}: export_hf {ranks[0]['export_s'] * 1e3:.1f} ms; the layout's own seeded init equals the "
          f"one-rank init in {seeded_equal}/{len(want)} tensors")
