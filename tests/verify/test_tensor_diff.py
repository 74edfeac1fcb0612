"""rel / max_abs / mean_abs / norm_ratio of a tensor pair."""

import math

import pytest
import torch

from ftexp.verify.tensor_diff import TensorDiff, tensor_diff

ZERO = TensorDiff(0.0, 0.0, 0.0, 0.0)


@pytest.fixture
def x():
    return torch.randn(64, 33, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int64])
def test_identical_is_exactly_zero(x, dtype):
    t = (x * 100).to(dtype)
    assert tensor_diff(t, t.clone()) == ZERO


def test_huge_identical_values_still_zero():
    # Squares overflow float64 here; identity must not depend on the arithmetic.
    t = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert tensor_diff(t, t.clone()).rel == 0.0


def test_uniform_scale_is_small_but_nonzero(x):
    d = tensor_diff(x, 1.02 * x)
    assert d.rel == pytest.approx(0.02**2 / (1 + 1.02**2), rel=1e-4)
    assert 0 < d.rel < 1e-3
    assert d.max_abs == pytest.approx(0.02 * x.abs().max().item(), rel=1e-4)


def test_sign_flip_is_two(x):
    assert tensor_diff(x, -x).rel == pytest.approx(2.0, abs=1e-15)


def test_unrelated_tensors_are_about_one(x):
    y = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    assert tensor_diff(x, y).rel == pytest.approx(1.0, abs=0.1)


def test_single_last_bit_flip_is_visible_in_rel(x):
    big = torch.randn(1000, 1000, generator=torch.Generator().manual_seed(2))
    y = big.clone()
    y[3, 7] = torch.nextafter(y[3, 7], torch.tensor(math.inf))
    d = tensor_diff(big, y)
    # The literal 1 - 2Σxy/Σ(x²+y²) rounds this to exactly 0 in float64.
    assert d.rel > 0
    assert d.max_abs == (y[3, 7] - big[3, 7]).item() > 0


def test_abs_numbers_on_a_small_example():
    d = tensor_diff(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.5, 2.0]))
    assert d.max_abs == 1.0
    assert d.mean_abs == pytest.approx(0.5)
    assert d.rel == pytest.approx((0.25 + 1.0) / (1 + 1 + 4 + 6.25 + 9 + 4))


def test_baseline_with_extra_leading_ones_is_squeezed(x):
    assert tensor_diff(x.reshape(1, 1, 64, 33), x.clone()) == ZERO
    assert tensor_diff(x.reshape(1, 64, 33), x * 2).rel > 0


@pytest.mark.parametrize("b_shape, t_shape", [((64, 33), (33, 64)), ((2, 64, 33), (64, 33)),
                                              ((64, 33, 1), (64, 33)), ((64, 33), (1, 64, 33))])
def test_other_shape_mismatches_raise(b_shape, t_shape):
    with pytest.raises(ValueError, match="shape mismatch"):
        tensor_diff(torch.zeros(b_shape), torch.zeros(t_shape))


def test_empty_and_all_zero():
    assert tensor_diff(torch.zeros(0, 3), torch.zeros(0, 3)) == ZERO
    assert tensor_diff(torch.zeros(5), -torch.zeros(5)) == ZERO
    # A zero baseline against a nonzero target: infinitely off in scale (fails every '<=').
    assert tensor_diff(torch.zeros(4), torch.ones(4)) == TensorDiff(1.0, 1.0, 1.0, math.inf)
    assert tensor_diff(torch.ones(4), torch.zeros(4)).norm_ratio == 1.0


def test_non_finite_values():
    nan_vec = torch.tensor([math.nan, 1.0])
    assert tensor_diff(nan_vec, nan_vec.clone()) == ZERO  # bitwise equal
    for b, t in [(nan_vec, torch.tensor([math.nan, 2.0])),
                 (torch.tensor([1.0, 2.0]), torch.tensor([1.0, math.inf])),
                 (torch.tensor([math.inf]), torch.tensor([-math.inf]))]:
        d = tensor_diff(b, t)
        assert all(math.isnan(v) for v in d.as_dict().values())


def test_different_dtypes_are_compared_by_value(x):
    assert tensor_diff(x, x.double()) == ZERO
    assert tensor_diff(x, x.bfloat16()).rel > 0


@pytest.mark.parametrize("scale", [0.5, 0.97, 0.98, 0.99, 1.02, 1.03])
def test_norm_ratio_sees_the_scale_rel_barely_sees(x, scale):
    d = tensor_diff(x, scale * x)
    assert d.norm_ratio == pytest.approx(abs(scale - 1), rel=1e-6)
    assert d.rel == pytest.approx((1 - scale) ** 2 / (1 + scale**2), rel=1e-4)
    if scale != 0.5:
        # A few percent: far inside the seed's rel <= 0.0085, far outside norm_ratio <= 0.015.
        assert d.rel < 0.001 and d.norm_ratio >= 0.0099


def test_norm_ratio_of_uncorrelated_noise_is_second_order():
    """Noise of relative size eps moves the norm by ~eps^2/2 + eps/sqrt(n): rel and norm_ratio agree."""
    b = torch.randn(100_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    noise = torch.randn(100_000, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    d = tensor_diff(b, b + 0.1 * noise)  # eps = 0.1
    assert d.rel == pytest.approx(0.01 / 2.01, rel=0.05)
    assert d.norm_ratio < 0.005 + 3 * 0.1 / math.sqrt(100_000)


def test_norm_ratio_is_symmetric_enough_and_exact_for_one_ulp(x):
    y = x.clone()
    y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(math.inf))
    d = tensor_diff(x, y)
    assert 0 < d.norm_ratio < 1e-7
    assert tensor_diff(x, 2 * x).norm_ratio == pytest.approx(1.0)
    assert tensor_diff(2 * x, x).norm_ratio == pytest.approx(0.5)
