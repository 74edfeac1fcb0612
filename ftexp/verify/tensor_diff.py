"""How far apart two tensors are: the four numbers a threshold predicate judges.

For a baseline tensor ``b`` and a target tensor ``t`` (both cast to float64):

- ``rel``      = 1 − 2·Σ(b·t) / Σ(b²+t²), a cosine-like distance (DeepGEMM style): 0 for equal
  tensors, about 1 for unrelated ones, 2 for ``t = −b``. It is scale-aware: ``t = 1.02·b`` gives
  only ≈ 2e-4, because a uniform scale barely changes the direction.
- ``max_abs``  = max |t − b|
- ``mean_abs`` = mean |t − b|
- ``norm_ratio`` = |‖t‖ / ‖b‖ − 1| (L2 norms): the scale error ``rel`` cannot see. ``t = 0.97·b``
  gives 0.03 (rel only ≈ 4.6e-4); uncorrelated noise of relative size ε moves it by only
  ≈ ε²/2 + ε/√n. A zero baseline gives 0 if the target is zero too, else +inf (infinitely off in
  scale: it fails every ``<=`` threshold, as rel = 1 does there).

``rel`` is evaluated as Σ(t−b)² / Σ(b²+t²), which is the same quantity (b²+t²−2bt = (t−b)²) but
numerically sharper: the literal ``1 − ratio`` rounds a one-ulp difference in a large tensor to
exactly 0 (the ratio is 1 − 1e-18, which is 1.0 in float64), so a bitwise rule ``rel <= 0`` would
pass it. Squared differences of float32/bf16 values are exact in float64, so this form is 0
exactly when the values are equal, and never negative.

Special cases: bitwise-identical tensors give exactly (0, 0, 0, 0), even if they hold NaN; otherwise
any NaN or ±inf makes all four numbers NaN (which fails every ``<=`` threshold); empty tensors and
two all-zero tensors give ``rel = 0`` and ``norm_ratio = 0``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorDiff:
    rel: float
    max_abs: float
    mean_abs: float
    norm_ratio: float

    def as_dict(self) -> dict[str, float]:
        """The numbers by the names a predicate reads them."""
        return {"rel": self.rel, "max_abs": self.max_abs, "mean_abs": self.mean_abs, "norm_ratio": self.norm_ratio}


_ZERO = TensorDiff(0.0, 0.0, 0.0, 0.0)
_NAN = TensorDiff(math.nan, math.nan, math.nan, math.nan)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes. Unlike torch.equal, NaN payloads compare equal to themselves."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    # A flat contiguous view as bytes works for every dtype, bf16 and bool included.
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def _align(baseline: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The baseline in the target's shape; only extra leading size-1 dims may be dropped."""
    if baseline.shape == target.shape:
        return baseline
    extra = baseline.dim() - target.dim()
    if extra > 0 and baseline.shape[extra:] == target.shape and all(d == 1 for d in baseline.shape[:extra]):
        return baseline.reshape(target.shape)
    raise ValueError(f"shape mismatch: baseline {tuple(baseline.shape)} vs target {tuple(target.shape)}")


def tensor_diff(baseline: torch.Tensor, target: torch.Tensor) -> TensorDiff:
    """The (rel, max_abs, mean_abs, norm_ratio) distance of ``target`` from ``baseline``; ValueError on shape mismatch."""
    baseline = _align(baseline.detach().cpu(), target)
    target = target.detach().cpu()
    if _bitwise_equal(baseline, target) or target.numel() == 0:
        return _ZERO
    b = baseline.to(torch.float64)
    t = target.to(torch.float64)
    if not (torch.isfinite(b).all() and torch.isfinite(t).all()):
        return _NAN
    delta = t - b
    abs_delta = delta.abs()
    denominator = (b * b + t * t).sum().item()
    # Both tensors all zero (possibly -0.0 vs 0.0): no direction to compare, and no difference.
    rel = (delta * delta).sum().item() / denominator if denominator > 0 else 0.0
    return TensorDiff(rel=rel, max_abs=abs_delta.max().item(), mean_abs=abs_delta.mean().item(),
                      norm_ratio=norm_ratio(b, t))


def norm_ratio(b: torch.Tensor, t: torch.Tensor) -> float:
    """|‖t‖/‖b‖ − 1| of two finite float64 tensors; 0 when both are zero, +inf when only b is."""
    b_norm, t_norm = b.norm().item(), t.norm().item()
    if b_norm == 0.0:
        return 0.0 if t_norm == 0.0 else math.inf
    return abs(t_norm / b_norm - 1.0)
