import torch

from ftexp.config import ModelConfig
from ftexp.engines.torch.model import build_model, token_log_probs


def test_forward_shape_and_parameter_names():
    cfg = ModelConfig()
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    assert model(tokens).shape == (3, 10, cfg.vocab_size)
    names = {name for name, _ in model.named_parameters()}
    for expected in ("embed.weight", "pos_embed.weight", "layers.0.attn.qkv.weight",
                     "layers.0.attn.proj.weight", "layers.1.mlp.fc1.weight",
                     "layers.1.mlp.fc2.bias", "final_norm.weight", "lm_head.weight"):
        assert expected in names


def test_build_model_is_bitwise_reproducible_and_leaves_global_rng_alone():
    rng_state = torch.get_rng_state()
    first, second = build_model(ModelConfig()), build_model(ModelConfig())
    assert torch.equal(rng_state, torch.get_rng_state())
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(first(tokens), second(tokens))
    other_seed = build_model(ModelConfig(seed=1))
    assert not torch.equal(first.embed.weight, other_seed.embed.weight)


def test_model_is_causal():
    model = build_model(ModelConfig())
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    with torch.no_grad():
        assert torch.allclose(model(tokens)[:, :8], model(changed)[:, :8], atol=1e-6)


def test_token_log_probs_pick_the_next_token():
    model = build_model(ModelConfig())
    tokens = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        log_probs = token_log_probs(model, tokens)
        expected = torch.log_softmax(model(tokens), dim=-1)[0, 2, tokens[0, 3]]
    assert log_probs.shape == (2, 5)
    assert torch.allclose(log_probs[0, 2], expected, atol=1e-6)
    assert (log_probs < 0).all()
