"""MegatronReplica's step math and state on one rank (a spawned process with its own gloo world).

The GRPO loss is scaled so that a rollout's gradient does not depend on how its samples are
split over microbatches or over data-parallel shards (cells), uneven shards included (what 3 cells
of a 4-cell run train on); the MoE preset's sequence-level aux loss is part of that gradient. State dicts cross the heal's wire
format bit for bit.
"""

import pytest
import torch
from loopback_world import join_world, rendezvous_port, spawn_ranks

SAMPLES = 16


def _worker(rank, out_path, port):
    import socket
    import threading

    import torch.distributed as dist

    from ftexp.config import Engine, MegatronConfig, ModeConfig, ModelConfig, RolloutConfig, TrainerConfig
    from ftexp.engines.grpo import make_train_batch, strided_shard
    from ftexp.engines.megatron.replica import MegatronReplica
    from ftexp.engines.torch.model import build_model
    from ftexp.rollout.recorded import generate_rollout
    from ftexp.trainer import transfer

    torch.set_num_threads(1)
    join_world(0, 1, port)
    cfg = TrainerConfig(engine=Engine.megatron, rollout=RolloutConfig(rollout_batch_size=4, n_samples_per_prompt=4),
                        megatron=MegatronConfig(micro_batch_size=4))
    mode = ModeConfig(name="one_rank", num_cells=1, model_preset="tiny_moe_5layer", engines=[Engine.megatron])
    rollout = generate_rollout(build_model(ModelConfig()), 0, cfg.rollout)
    replica = MegatronReplica(cfg, mode, seed=1)

    def grads(indices, num_shards, micro_batch):
        """[grads, stats] as this shard hands them to the reduce across cells."""
        replica.micro_batch_target = micro_batch
        replica.zero_grad()
        handed = []
        replica.forward_backward_reduce(make_train_batch(rollout, indices), SAMPLES, num_shards, lambda: None,
                                        lambda flat: handed.append(flat.clone()) or True)
        return handed[0]

    everything = list(range(SAMPLES))
    out = {
        "one_shard": grads(everything, 1, 4),
        "regrouped": grads(everything, 1, 8),
        "two_shards": grads(strided_shard(SAMPLES, 0, 2), 2, 4) + grads(strided_shard(SAMPLES, 1, 2), 2, 4),
        # 6/5/5 samples: microbatches of 3 and of 5, no padding rows in the aux loss
        "three_uneven_shards": sum(grads(strided_shard(SAMPLES, r, 3), 3, 4) for r in range(3)),
    }
    replica.optimizer_step(0)
    replica.zero_grad()
    healed = MegatronReplica(cfg, mode, seed=2)
    # As a heal moves it: over a socket, into the healed replica's own tensors (both have Adam's state).
    source, receiver = socket.socketpair()
    sender = threading.Thread(target=transfer.send_state, args=(source, transfer.encode(replica.state_dict())))
    sender.start()
    state, _ = transfer.recv_state(receiver, transfer.layout(healed.state_dict()))
    sender.join()
    healed.load_state_dict(state)
    out["source_checksums"], out["healed_checksums"] = replica.checksums(), healed.checksums()
    out["fresh_checksums"] = MegatronReplica(cfg, mode, seed=1).checksums()
    torch.save(out, out_path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("replica") / "out.pt"
    spawn_ranks(_worker, args=(str(out), rendezvous_port()), nprocs=1)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("split", ["regrouped", "two_shards", "three_uneven_shards"])
def test_gradient_does_not_depend_on_the_split(results, split):
    reference = results["one_shard"]
    assert reference[:-5].abs().max() > 0  # grads (the last 5 entries are the stats)
    torch.testing.assert_close(results[split], reference, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_state_round_trips_through_the_heal_codec(results):
    assert results["healed_checksums"] == results["source_checksums"]
    fresh, trained = results["fresh_checksums"], results["source_checksums"]
    assert fresh["param_hashes"] != trained["param_hashes"]  # the step changed the weights ...
    assert fresh["optimizer_hashes"] != trained["optimizer_hashes"]  # ... and created Adam state
