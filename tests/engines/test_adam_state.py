"""Adam's state made up front (``make_adam_state``) trains exactly as the state Adam makes at its first step."""

import pytest
import torch

from ftexp.engines.base import make_adam_state


def _train(optimizer_class, eager: bool, steps: int = 3):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    optimizer = optimizer_class(params, lr=0.1, weight_decay=0.01, foreach=False)
    if eager:
        make_adam_state(optimizer)
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=grads)
        optimizer.step()
    return params, optimizer.state_dict()


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW])
def test_eager_state_steps_bit_for_bit_like_lazy_state(optimizer_class):
    lazy_params, lazy_state = _train(optimizer_class, eager=False)
    eager_params, eager_state = _train(optimizer_class, eager=True)
    for lazy, eager in zip(lazy_params, eager_params):
        assert torch.equal(lazy, eager)
    torch.testing.assert_close(eager_state, lazy_state, rtol=0, atol=0)


def test_eager_state_is_what_the_first_step_would_find():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([param])
    make_adam_state(optimizer)
    state = optimizer.state[param]
    assert state["step"].item() == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_an_adam_with_other_state_is_refused():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)
    with pytest.raises(ValueError, match="plain Adam"):
        make_adam_state(optimizer)
