"""The witness in the model and in the step: invisible to the policy, visible in its own rows."""

import dataclasses

import pytest
import torch

from ftexp.audit.analyzer import witness as witness_rule
from ftexp.audit.events import (EventLogger, ProcessIdentity, TrainAdvantageComputationEvent, TrainGroupStepEndEvent,
                                WitnessSnapshotParamEvent, read_events)
from ftexp.audit.witness import WitnessIdAllocator, allocation_event, merged, ranges_of
from ftexp.config import ModelConfig, RolloutConfig, TrainerConfig
from ftexp.engines.grpo import make_train_batch
from ftexp.engines.torch.loss import grpo_loss
from ftexp.engines.torch.model import build_model
from ftexp.engines.torch.replica import TorchReplica
from ftexp.engines.torch.witness import Witness, nonzero_witness_ranges, zero_witness_rows
from ftexp.errors import InputError
from ftexp.rollout.recorded import generate_rollout
from ftexp.trainer.step import train_step

BUFFER = 4096
SAMPLES = 64
ROLLOUT = RolloutConfig(rollout_batch_size=8, n_samples_per_prompt=8)


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def rollout_with_uniform_group(rollout_id: int = 0) -> dict:
    """A recorded rollout whose prompt group 1 got the same reward everywhere: zero advantage."""
    rollout = generate_rollout(build_model(ModelConfig()), rollout_id, ROLLOUT)
    for sample in rollout["samples"][8:16]:
        sample["reward"] = 1.0
    return rollout


@pytest.fixture(scope="module")
def rollout():
    return rollout_with_uniform_group()


def policy_params(model):
    return {n: p for n, p in model.named_parameters() if "witness" not in n}


def test_witnesses_start_at_zero_and_leave_the_policy_init_alone():
    plain, witnessed = build_model(ModelConfig()), build_model(ModelConfig(), BUFFER)
    assert set(policy_params(witnessed)) == {n for n, _ in plain.named_parameters()}
    for name, p in plain.named_parameters():
        assert torch.equal(p, policy_params(witnessed)[name]), name
    assert list(witnessed.witnesses()) == ["pp0_chunk0.local_head", "pp0_chunk0.local_tail"]
    for w in witnessed.witnesses().values():
        assert w.weight.shape == (BUFFER, 1) and not w.weight.any()
    assert plain.witnesses() == {}


def test_witness_changes_no_bit_of_the_loss_or_policy_gradients(rollout):
    plain, witnessed = build_model(ModelConfig()), build_model(ModelConfig(), BUFFER)
    with torch.no_grad():  # trained rows are non-zero; the forward must still add exactly 0
        for w in witnessed.witnesses().values():
            w.weight.normal_(generator=torch.Generator().manual_seed(3))
    ids = list(range(100, 100 + SAMPLES))
    loss_plain, _ = grpo_loss(plain, make_train_batch(rollout, list(range(SAMPLES))), SAMPLES)
    loss_witnessed, _ = grpo_loss(witnessed, make_train_batch(rollout, list(range(SAMPLES)), ids), SAMPLES)
    loss_plain.backward()
    loss_witnessed.backward()
    assert torch.equal(loss_plain, loss_witnessed)
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, policy_params(witnessed)[name].grad), name


def test_witness_gradient_marks_exactly_the_trained_samples(rollout):
    model = build_model(ModelConfig(), BUFFER)
    shard = list(range(0, SAMPLES, 2))
    ids = [1000 + 3 * i for i in range(SAMPLES)]  # non-contiguous ids: rows must follow the ids, not positions
    batch = make_train_batch(rollout, shard, ids)
    loss, _ = grpo_loss(model, batch, SAMPLES)
    loss.backward()
    zero_advantage = {ids[i] for i in shard if 8 <= i < 16}
    trained = {ids[i] for i in shard} - zero_advantage
    for witness in model.witnesses().values():
        grad = witness.weight.grad.view(-1)
        assert set(torch.nonzero(grad).view(-1).tolist()) == trained
        assert (grad[sorted(trained)] > 0).all()  # |grad| sums cannot cancel


def test_make_train_batch_wants_one_witness_id_per_sample(rollout):
    with pytest.raises(InputError, match="witness ids"):
        make_train_batch(rollout, [0, 1], [0, 1])


def test_zero_witness_rows_clears_weight_and_adam_moments():
    model = build_model(ModelConfig(), 16)
    witness = model.witnesses()["pp0_chunk0.local_head"]
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
    zero_witness_rows(witness, optimizer, [(0, 16)])  # no optimizer state yet: weight only
    witness.weight.grad = torch.ones(16, 1)
    optimizer.step()
    zero_witness_rows(witness, optimizer, [(14, 16), (0, 2)])
    state = optimizer.state[witness.weight]
    for t in (witness.weight, state["exp_avg"], state["exp_avg_sq"]):
        rows = t.view(-1)
        assert not rows[[0, 1, 14, 15]].any() and rows[2:14].ne(0).all()


def config(**kw) -> TrainerConfig:
    return TrainerConfig(rollout=ROLLOUT, witness_buffer_size=BUFFER, **{"enable_witness": True, **kw})


def run_steps(replica, rollouts, events, allocator):
    """Train each rollout once as a single replica (the identity reduce); return the metrics."""
    metrics = []
    for rollout_id, rollout in enumerate(rollouts):
        info = allocator.allocate(SAMPLES) if allocator is not None else None
        ok, m = train_step(replica, rollout, rollout_id, 0, shard_rank=0, shard_size=1, witness=info, events=events,
                           reduce=lambda flat: True)
        assert ok
        metrics.append(m)
    return metrics


def test_replica_with_witness_trains_the_policy_bit_for_bit_like_without(tmp_path):
    rollouts = [rollout_with_uniform_group(r) for r in range(3)]
    events = EventLogger(tmp_path, ProcessIdentity(component="dp", rank_within_cell=0))
    plain, witnessed = TorchReplica(config(enable_witness=False), seed=1), TorchReplica(config(), seed=1)
    assert run_steps(plain, rollouts, events, None) == run_steps(witnessed, rollouts, events, WitnessIdAllocator(BUFFER))
    for name, p in zip(plain.param_names, plain.params):
        assert torch.equal(p, policy_params(witnessed.model)[name]), name
    assert witnessed.policy_param_names == plain.param_names


def test_step_logs_advantages_and_snapshots_and_zeroes_stale_rows(tmp_path):
    # A ring of 220 slots: keep = 154, so 66 slots are stale after each step once 154 ids were handed
    # out. Rollout 3 (ids 192..255) reuses slots 0..35, which rollout 2's step zeroed.
    buffer = 220
    rollouts = [rollout_with_uniform_group(r) for r in range(4)]
    events = EventLogger(tmp_path, ProcessIdentity(component="actor", cell_index=0, rank_within_cell=0))
    replica = TorchReplica(dataclasses.replace(config(), witness_buffer_size=buffer), seed=1)
    allocator = WitnessIdAllocator(buffer)
    run_steps(replica, rollouts, events, allocator)
    logged = read_events(tmp_path)
    adv = [e for e in logged if isinstance(e, TrainAdvantageComputationEvent)]
    assert [e.rollout_id for e in adv] == [0, 1, 2, 3]
    assert len(adv[0].advantages) == SAMPLES and all(len(a) == ROLLOUT.response_len for a in adv[0].advantages)
    assert adv[0].witness_ids[9] == [9] * ROLLOUT.response_len and adv[0].advantages[9] == [0.0] * ROLLOUT.response_len
    snaps = [e for e in logged if isinstance(e, WitnessSnapshotParamEvent)]
    assert [(e.rollout_id, e.instance_id) for e in snaps[:2]] == [(0, "pp0_chunk0.local_head"), (0, "pp0_chunk0.local_tail")]
    assert [e.stale_id_ranges for e in snaps[::2]] == [[(64, 220)], [(128, 220)], [(192, 220), (0, 38)], [(36, 102)]]

    def samples(first_id, *, without_zero_advantage=True):  # the ids of one rollout, less its uniform group
        return {(first_id + i) % buffer for i in range(SAMPLES) if not (without_zero_advantage and 8 <= i < 16)}

    assert merged(snaps[0].nonzero_witness_id_ranges) == ranges_of(samples(0))
    # Before rollout 3's zeroing: rollout 0's rows 0..37 were zeroed after rollout 2 and 0..35 retrained.
    assert merged(snaps[6].nonzero_witness_id_ranges) == ranges_of((samples(0) - set(range(38))) | samples(64) | samples(128) | samples(192))
    for witness in replica.model.witnesses().values():
        state = replica.optimizer.state[witness.weight]
        for t in (witness.weight, state["exp_avg"], state["exp_avg_sq"]):
            assert not t[36:102].any() and t[0:36].any()
    # The analyzer agrees, given the allocations and commits the driver would have logged.
    replay = WitnessIdAllocator(buffer)
    log = logged + [e for r in range(4) for e in (allocation_event(r, 0, replay.allocate(SAMPLES), replay.counter),
                                                  TrainGroupStepEndEvent(rollout_id=r, cell_outcomes={0: ["normal"]}))]
    assert witness_rule(log) == []


def test_witness_travels_in_state_and_checksums_but_not_in_dumps(tmp_path, rollout):
    replica = TorchReplica(config(), seed=1)
    run_steps(replica, [rollout], EventLogger(tmp_path / "ev", ProcessIdentity(component="main")),
              WitnessIdAllocator(BUFFER))
    state = replica.state_dict()
    assert "local_head_witness.weight" in state["model"]
    assert {k for k in replica.checksums()["param_hashes"] if "witness" in k} == {
        "pp0.local_head_witness.weight", "pp0.local_tail_witness.weight"}
    assert any(k.startswith("local_tail_witness.weight.exp_avg") for k in replica.checksums()["optimizer_hashes"])
    healed = TorchReplica(config(), seed=2)
    healed.load_state_dict(state)
    assert healed.checksums() == replica.checksums()
    replica.dump(tmp_path / "dump")
    names = [p.name for p in (tmp_path / "dump").iterdir()]
    assert names and not [n for n in names if "witness" in n]


def test_train_step_wants_witness_ids_exactly_when_the_model_has_witnesses(tmp_path, rollout):
    events = EventLogger(tmp_path, ProcessIdentity(component="main"))
    with pytest.raises(ValueError, match="enable_witness"):
        run_steps(TorchReplica(config(), seed=1), [rollout], events, None)
    with pytest.raises(ValueError, match="enable_witness"):
        run_steps(TorchReplica(config(enable_witness=False), seed=1), [rollout], events, WitnessIdAllocator(BUFFER))


def test_nonzero_rows_are_reported_as_runs_of_consecutive_ids():
    witness = Witness(16)
    with torch.no_grad():
        witness.weight.zero_()
        witness.weight[[0, 1, 2, 5, 9, 10, 15]] = 1.0
    assert nonzero_witness_ranges(witness) == [(0, 3), (5, 6), (9, 11), (15, 16)]
    with torch.no_grad():
        witness.weight.zero_()
    assert nonzero_witness_ranges(witness) == []
