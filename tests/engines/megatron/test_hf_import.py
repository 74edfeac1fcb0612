"""HF checkpoint -> Megatron: the imported replica is the checkpoint's model, on every layout.

Tiny random Qwen3 (untied and tied embeddings) and Qwen3-MoE checkpoints (``hf_checkpoints``: head dim !=
hidden / heads, RoPE base 1e6, epsilon 1e-6, scrambled norms) are loaded by `MegatronReplica` through
``mode.hf_checkpoint`` on one rank, on TP2 (dense) and TP2 + EP2 + SP (MoE): Megatron's logits for
fixed tokens must be transformers' own (``from_pretrained``) within 1e-5, and exporting the replica
(``export_hf``: gathered over TP / EP / PP) must give back the checkpoint's tensors bit for bit — on
PP2 (tied: the last stage's output layer is a copy) and a TP2 + PP2 + EP2 + SP replica too. Planted
import bugs (k and v swapped, gate and up swapped, q / k / v not interleaved per query group) must
change the logits.
"""

import pytest
import torch
from hf_checkpoints import write_checkpoint
from loopback_world import join_world, rendezvous_port, spawn_ranks
from megatron_harness import _quiet_expected_warnings

from ftexp.config import Engine, MegatronConfig, ModeConfig, RolloutConfig, TrainerConfig

TOKENS_SHAPE = (2, 24)
LOGIT_ATOL = 1e-5


def _stack_plainly(to_megatron):
    """The bug: q, k, v stacked whole instead of interleaved per query group."""
    return lambda name, hf, preset: torch.cat(hf) if len(hf) == 3 else to_megatron(name, hf, preset)


PLANTED = {  # an import bug -> how it wraps hf_import.to_megatron
    "k and v swapped": lambda f: lambda name, hf, preset: f(name, [hf[0], hf[2], hf[1]] if len(hf) == 3 else hf, preset),
    "gate and up swapped": lambda f: lambda name, hf, preset: f(name, hf[::-1] if len(hf) == 2 else hf, preset),
    "q, k, v not grouped": _stack_plainly,
}


def _replica(path, **layout):
    from ftexp.engines.megatron.replica import MegatronReplica

    mode = ModeConfig(name="hf_import", num_cells=1, hf_checkpoint=str(path), engines=[Engine.megatron], **layout)
    cfg = TrainerConfig(engine=Engine.megatron, rollout=RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2),
                        megatron=MegatronConfig(micro_batch_size=2))
    return MegatronReplica(cfg, mode, seed=1)


def _logits(replica, tokens):
    """The full-vocabulary logits (TP shards gathered) of the last pipeline stage."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    replica.module.eval()
    with torch.no_grad():
        out = replica.module(input_ids=tokens, position_ids=torch.arange(tokens.shape[1]).expand_as(tokens),
                             attention_mask=None)
        return gather_from_tensor_model_parallel_region(out)


def _worker(rank, world, port, runs, out_path):
    """`runs`: (key, checkpoint dir, layout, with logits, planted bug or None) run in order on every rank."""
    import torch.distributed as dist

    from ftexp.engines.megatron import hf_import

    _quiet_expected_warnings()
    torch.set_num_threads(1)
    join_world(rank, world, port)
    tokens = torch.randint(0, 128, TOKENS_SHAPE, generator=torch.Generator().manual_seed(3))
    original, out = hf_import.to_megatron, {}
    for key, path, layout, with_logits, bug in runs:
        hf_import.to_megatron = PLANTED[bug](original) if bug else original
        replica = _replica(path, **layout)
        logits = _logits(replica, tokens) if with_logits else None
        exported = replica.export_hf()
        out[key] = dict(logits=logits, exported=exported)
    if rank == 0:
        torch.save(dict(tokens=tokens, runs=out), out_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_import")
    return {"dense": write_checkpoint(root / "dense"), "moe": write_checkpoint(root / "moe", moe=True),
            "tied": write_checkpoint(root / "tied", seed=3, tie_word_embeddings=True),
            "moe_unnormalised": write_checkpoint(root / "moe_unnormalised", moe=True, seed=5, norm_topk_prob=False)}


def _spawn(world, runs, tmp_path):
    spawn_ranks(_worker, args=(world, rendezvous_port(), runs, str(tmp_path / "out.pt")), nprocs=world)
    return torch.load(tmp_path / "out.pt", weights_only=False)


def _hf_logits(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _checkpoint_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


TP2 = dict(tp=2)
TP2_EP2_SP = dict(tp=2, ep=2, sequence_parallel=True)
TP2_PP2_EP2_SP = dict(tp=2, pp=2, ep=2, sequence_parallel=True)


@pytest.fixture(scope="module")
def one_rank(checkpoints, tmp_path_factory):
    runs = [(name, path, {}, True, None) for name, path in checkpoints.items()]
    runs += [(f"dense/{bug}", checkpoints["dense"], {}, True, bug) for bug in PLANTED]
    runs += [(f"moe/{bug}", checkpoints["moe"], {}, True, bug) for bug in ("gate and up swapped",)]
    return _spawn(1, runs, tmp_path_factory.mktemp("one_rank"))


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    runs = [("dense", checkpoints["dense"], TP2, True, None), ("moe", checkpoints["moe"], TP2_EP2_SP, True, None),
            ("tied", checkpoints["tied"], TP2, True, None), ("tied_pp2", checkpoints["tied"], dict(pp=2), False, None)]
    return _spawn(2, runs, tmp_path_factory.mktemp("two_ranks"))


def _differing(got: dict, want: dict) -> list[str]:
    """The names whose tensors are not bitwise equal (both sides must hold the same names)."""
    assert got.keys() == want.keys()
    return [n for n in want if not torch.equal(got[n], want[n])]


def _assert_same_logits_and_round_trip(world: dict, checkpoints, name: str, layout: str) -> None:
    """The imported model gives the checkpoint's logits and exports the checkpoint back bit for bit."""
    run = world["runs"][name]
    diff = (run["logits"] - _hf_logits(checkpoints[name], world["tokens"])).abs().max().item()
    print(f"{name}, {layout}: max |Megatron - HF| logit = {diff:.2e}")
    assert diff <= LOGIT_ATOL
    assert _differing(run["exported"], _checkpoint_tensors(checkpoints[name])) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "tied", "moe", "moe_unnormalised"])
def test_one_rank_import_gives_the_checkpoints_logits_and_exports_it_back(one_rank, checkpoints, name):
    _assert_same_logits_and_round_trip(one_rank, checkpoints, name, "one rank")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "tied", "moe"])
def test_tensor_and_expert_parallel_import_gives_the_checkpoints_logits(two_ranks, checkpoints, name):
    _assert_same_logits_and_round_trip(two_ranks, checkpoints, name, "TP2 EP2 SP" if name == "moe" else "TP2")


@pytest.mark.slow
def test_pipeline_parallel_import_of_tied_embeddings_round_trips_bit_for_bit(two_ranks, checkpoints):
    got = two_ranks["runs"]["tied_pp2"]["exported"]
    assert "lm_head.weight" not in got
    assert _differing(got, _checkpoint_tensors(checkpoints["tied"])) == []


@pytest.mark.slow
def test_pipeline_tensor_and_expert_parallel_import_round_trips_bit_for_bit(checkpoints, tmp_path):
    out = _spawn(4, [("moe", checkpoints["moe"], TP2_PP2_EP2_SP, False, None)], tmp_path)
    assert _differing(out["runs"]["moe"]["exported"], _checkpoint_tensors(checkpoints["moe"])) == []


def _train_worker(rank, world, port, path, layout, out_dir):
    """One supervised step of the imported replica; every rank saves its parameters by global name."""
    import torch.distributed as dist

    from ftexp.tasks.base import ASCII, Problem
    from ftexp.tasks.warmup import supervised_batch

    _quiet_expected_warnings()
    torch.set_num_threads(1)
    join_world(rank, world, port)
    replica = _replica(path, **layout)
    batch = supervised_batch([Problem("12+7=", "19", "19"), Problem("3-5=", "-2", "-2")], ASCII)
    loss = replica.supervised_step(batch, lr=1e-2)
    torch.save(dict(loss=loss, params={replica.global_names[n]: p.detach().clone()
                                       for n, p in replica.module.named_parameters()}), f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_tied_embeddings_stay_tied_through_a_pipeline_parallel_training_step(checkpoints, tmp_path):
    """On PP2 the last stage's output layer is a copy of the embedding: the step must keep it one (and match PP1)."""
    runs = {}
    for name, layout, world in (("pp1", {}, 1), ("pp2", dict(pp=2), 2)):
        (tmp_path / name).mkdir()
        spawn_ranks(_train_worker, nprocs=world,
                    args=(world, rendezvous_port(), str(checkpoints["tied"]), layout, str(tmp_path / name)))
        runs[name] = [torch.load(tmp_path / name / f"rank{r}.pt") for r in range(world)]
    embedding = "embedding.word_embeddings.weight"
    first, last = runs["pp2"][0]["params"], runs["pp2"][1]["params"]
    assert torch.equal(last["output_layer.weight"], first[embedding])
    before = _checkpoint_tensors(checkpoints["tied"])["model.embed_tokens.weight"]
    step = (runs["pp1"][0]["params"][embedding] - before).abs().max().item()
    diff = (first[embedding] - runs["pp1"][0]["params"][embedding]).abs().max().item()
    print(f"tied, one step: embedding moved by up to {step:.2e}; PP2 vs PP1 differ by {diff:.2e}")
    assert step > 1e-3  # the step moved the embedding, through both of its uses
    assert diff <= 1e-6
    assert abs(runs["pp2"][0]["loss"] - runs["pp1"][0]["loss"]) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("key", [f"dense/{bug}" for bug in PLANTED] + ["moe/gate and up swapped"])
def test_a_planted_import_bug_changes_the_logits(one_rank, checkpoints, key):
    diff = (one_rank["runs"][key]["logits"] - _hf_logits(checkpoints[key.split("/")[0]], one_rank["tokens"])).abs().max()
    assert diff.item() > 100 * LOGIT_ATOL, f"{key}: logits still agree ({diff.item():.1e})"
