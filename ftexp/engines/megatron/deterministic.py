"""Fixed-order gradient reduction inside Megatron's DDP, for ``scenario.deterministic``.

Megatron's DDP scales each gradient bucket by 1/(dp·cp) and SUM-all-reduces it over the
data-parallel(×CP) group; gloo's ring adds the ranks in an order that depends on the group size.
The baseline reduces over dp·cp ranks in one go, a cell over its cp ranks and then across cells,
so the two agree only to rounding. With this patch the bucket all-reduce is an all-gather plus
the fixed fold of ``ftexp.engines.collectives.tree_fold``: the baseline's group of ranks
(dp0·cp0, dp0·cp1, dp1·cp0, dp1·cp1) folds as ((a + b) + (c + d)), exactly what a cell's CP
fold followed by the cross-cell fold computes — bit for bit, since the 1/(dp·cp) scalings are
powers of two.

Only the bucket reduce of ``megatron.core.distributed.param_and_grad_buffer`` sees it.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist

from ftexp.engines.collectives import tree_fold


def _fixed_order_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    if op != dist.ReduceOp.SUM:
        raise NotImplementedError(f"deterministic grad reduce supports SUM only, got {op}")
    size = dist.get_world_size(group)
    if size > 1:
        gathered = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(gathered, tensor, group=group)
        tensor.copy_(tree_fold(gathered))
    return None


class _Distributed(types.ModuleType):
    """``torch.distributed`` with the fixed-order all-reduce."""

    all_reduce = staticmethod(_fixed_order_all_reduce)

    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return getattr(dist, name)


class _Torch(types.ModuleType):
    def __init__(self, base):
        super().__init__("torch")
        self._base = base
        self.distributed = _Distributed()

    def __getattr__(self, name):
        return getattr(self._base, name)


@contextlib.contextmanager
def _no_coalescing(*args, **kwargs):
    yield None  # the gathers run one by one; nothing is left to wait for


def use_fixed_order_grad_reduce() -> None:
    """Make every DDP bucket reduce a fixed-order fold; idempotent. Call after the CPU patches."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    if isinstance(buffers.torch, _Torch):
        return
    buffers.torch = _Torch(buffers.torch)
    buffers._coalescing_manager = _no_coalescing
