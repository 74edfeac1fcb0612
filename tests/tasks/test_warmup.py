"""The supervised warm-up on the megatron engine (one rank, its own gloo world, in a spawned process).

It must teach (the loss falls), leave the replica where GRPO expects it (the trainer's learning rate
back, no rollout counted), and be a pure function of (initial weights, seed): two cells that warm up
alike come out bitwise equal, optimizer and RNG state included, while another seed's batches differ.
"""

import pytest
import torch
from loopback_world import join_world, rendezvous_port, spawn_ranks


def _worker(rank, out_path, port):
    import torch.distributed as dist

    from ftexp.config import Engine, ModeConfig, TaskConfig, TaskName, TrainerConfig, WarmupConfig
    from ftexp.engines.megatron.replica import MegatronReplica
    from ftexp.tasks import build_task
    from ftexp.tasks.base import ASCII
    from ftexp.tasks.warmup import warm_up

    torch.set_num_threads(1)
    join_world(0, 1, port)
    cfg = TrainerConfig(engine=Engine.megatron, lr=3e-4)
    mode = ModeConfig(name="one_rank", num_cells=1, model_preset="tiny_dense", engines=[Engine.megatron])
    task = build_task(TaskConfig(name=TaskName.arith))
    warmup = WarmupConfig(steps=40, batch_size=16, lr=1e-3)
    out = {"fresh": MegatronReplica(cfg, mode, seed=1).checksums()}
    for name, seed in (("cell0", 1), ("cell1", 1), ("other_seed", 2)):
        replica = MegatronReplica(cfg, mode, seed=1)
        out[f"{name}_losses"] = warm_up(replica, task, warmup, seed=seed, announce=False, tokenizer=ASCII)
        out[name] = replica.checksums()
        out[f"{name}_lr"] = replica.optimizer.param_groups[0]["lr"]
        out[f"{name}_last_rollout_id"] = replica.last_rollout_id
    torch.save(out, out_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("warmup") / "out.pt"
    spawn_ranks(_worker, args=(str(out), rendezvous_port()), nprocs=1)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_warmup_teaches_and_hands_over_to_grpo(results):
    losses = results["cell0_losses"]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    assert results["cell0_lr"] == 3e-4 and results["cell0_last_rollout_id"] == -1
    assert results["cell0"]["param_hashes"] != results["fresh"]["param_hashes"]


@pytest.mark.slow
def test_cells_that_warm_up_alike_are_bitwise_equal(results):
    assert results["cell0"] == results["cell1"]  # params, optimizer state and RNG
    assert results["cell0_losses"] == results["cell1_losses"]
    assert results["other_seed"]["param_hashes"] != results["cell0"]["param_hashes"]
    assert results["other_seed"]["rng_hashes"] == results["cell0"]["rng_hashes"]  # the warm-up draws no randomness
