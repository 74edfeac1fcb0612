import pytest
import torch

from ftexp.errors import InputError
from ftexp.config import ModelConfig, RolloutConfig
from ftexp.engines.grpo import group_advantages, make_train_batch, strided_shard
from ftexp.engines.torch.loss import grpo_loss
from ftexp.engines.torch.model import build_model
from ftexp.rollout.recorded import generate_rollout

NUM_SAMPLES = 256


@pytest.fixture(scope="module")
def rollout():
    return generate_rollout(build_model(ModelConfig()), 0, RolloutConfig())


@pytest.fixture
def moved_model():
    """A policy that has drifted from the sampling one, so ratios differ from 1 and some clip."""
    model = build_model(ModelConfig())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def test_group_advantages_are_normalised_per_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, 4)
    assert torch.allclose(advantages.view(2, 4).mean(dim=1), torch.zeros(2), atol=1e-6)
    assert torch.allclose(advantages[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(advantages[4:], torch.zeros(4))  # uniform group: no signal
    with pytest.raises(InputError):
        group_advantages(rewards, 3)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_strided_shard_partitions_exactly(size):
    shards = [strided_shard(NUM_SAMPLES, rank, size) for rank in range(size)]
    assert sorted(i for shard in shards for i in shard) == list(range(NUM_SAMPLES))
    assert all(i % size == rank for rank, shard in enumerate(shards) for i in shard)


def test_strided_shard_validates_rank():
    for rank, size in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(InputError):
            strided_shard(NUM_SAMPLES, rank, size)


def test_train_batch_layout(rollout):
    batch = make_train_batch(rollout, [3, 10])
    sample = rollout["samples"][10]
    assert batch.tokens.shape == (2, 24) and batch.loss_mask.shape == (2, 23)
    assert batch.tokens[1].tolist() == sample["tokens"]
    assert batch.loss_mask[1].tolist() == [0.0] * 7 + [1.0] * 16
    assert batch.old_log_probs[1, 7:].tolist() == pytest.approx(sample["rollout_log_probs"])
    assert batch.sample_indices.tolist() == [3, 10]
    full = make_train_batch(rollout, list(range(NUM_SAMPLES)))
    assert torch.equal(batch.advantages, full.advantages[[3, 10]])


def test_train_batch_pads_shorter_samples(rollout):
    samples = [dict(s) for s in rollout["samples"]]
    short = samples[1]
    short.update(tokens=short["tokens"][:-4], response_length=12, loss_mask=[1] * 12,
                 rollout_log_probs=short["rollout_log_probs"][:12])
    batch = make_train_batch({**rollout, "samples": samples}, [0, 1])
    assert batch.tokens.shape == (2, 24)
    assert batch.tokens[1, 20:].tolist() == [0] * 4
    assert batch.loss_mask[1].tolist() == [0.0] * 7 + [1.0] * 12 + [0.0] * 4


def test_initial_policy_has_unit_ratio(rollout):
    batch = make_train_batch(rollout, list(range(NUM_SAMPLES)))
    loss, stats = grpo_loss(build_model(ModelConfig()), batch, NUM_SAMPLES)
    # ratio == 1 everywhere, so the loss is -mean(advantage), which is zero per group.
    assert abs(loss.item()) < 1e-6
    assert stats["pg_clipfrac"].item() == 0.0
    assert abs(stats["ppo_kl"].item()) < 1e-6
    assert 0 < stats["entropy"].item() <= torch.log(torch.tensor(64.0)).item()
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def _loss_and_grads(model, rollout, sample_indices):
    model.zero_grad()
    loss, stats = grpo_loss(model, make_train_batch(rollout, sample_indices), NUM_SAMPLES)
    loss.backward()
    return loss.detach(), stats, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("size", [2, 4])
def test_shard_gradients_sum_to_full_batch_gradient(rollout, moved_model, size):
    full_loss, full_stats, full_grads = _loss_and_grads(moved_model, rollout, list(range(NUM_SAMPLES)))
    assert full_stats["pg_clipfrac"].item() > 0  # the clipped branch is exercised too
    shards = [_loss_and_grads(moved_model, rollout, strided_shard(NUM_SAMPLES, rank, size))
              for rank in range(size)]
    assert torch.allclose(sum(loss for loss, _, _ in shards), full_loss, atol=1e-6)
    for key, value in full_stats.items():
        assert torch.allclose(sum(stats[key] for _, stats, _ in shards), value, atol=1e-6), key
    for name, grad in full_grads.items():
        assert grad.abs().max() > 0, name
        assert torch.allclose(sum(grads[name] for _, _, grads in shards), grad, atol=1e-6), name


def test_grpo_loss_is_bitwise_deterministic(rollout, moved_model):
    indices = strided_shard(NUM_SAMPLES, 1, 2)
    first = _loss_and_grads(moved_model, rollout, indices)
    second = _loss_and_grads(moved_model, rollout, indices)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])


def test_training_on_one_rollout_reduces_the_loss(rollout):
    model = build_model(ModelConfig())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = make_train_batch(rollout, list(range(NUM_SAMPLES)))
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss, _ = grpo_loss(model, batch, NUM_SAMPLES)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Starts at ~0 (ratio 1, zero-mean advantages); the clipped objective bottoms out near -0.13.
    assert losses[-1] < losses[0] - 0.05
