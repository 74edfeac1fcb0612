"""SUM reductions over a process group, optionally in a fixed order (deterministic mode).

Floating-point addition is not associative: gloo's ring allreduce adds the ranks' values in an
order that depends on the world size and the chunking, so plain DP over N ranks and N cells that
reduce across cells need not agree in the last bit. In deterministic mode every order-sensitive
SUM is done as *all-gather + a fixed local fold* instead:

* world size a power of two: a pairwise tree ``((r0 + r1) + (r2 + r3)) + ...``;
* otherwise an ascending-rank fold ``((r0 + r1) + r2) + ...``.

Every rank folds the same gathered values in the same order, so every rank holds the same bits,
and two topologies with the same per-rank inputs (baseline rank i and target cell i train the
same strided shard) produce bitwise-identical sums. The fold works on any group that offers
a list-form ``allgather``: a torch.distributed world or a torchft cross-cell group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def tree_fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum ``parts`` in the fixed order described in the module docstring."""
    if not parts:
        raise ValueError("nothing to fold")
    n = len(parts)
    if n & (n - 1) == 0:  # power of two: pairwise tree
        level = list(parts)
        while len(level) > 1:
            level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
        return level[0].clone() if n == 1 else level[0]
    return ascending_fold(parts)


def ascending_fold(parts: list[torch.Tensor]) -> torch.Tensor:
    """``((r0 + r1) + r2) + ...``: the fold for sizes that are not a power of two."""
    if len(parts) == 1:
        return parts[0].clone()
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total = total + p
    return total


def _opts_allgather():
    return torch._C._distributed_c10d.AllgatherOptions()


def sum_across(group, tensor: torch.Tensor, *, world_size: int, deterministic: bool, torchft: bool,
               fold: Callable[[list[torch.Tensor]], torch.Tensor] = tree_fold) -> None:
    """In place: ``tensor`` ← SUM of ``tensor`` over ``group``.

    ``torchft`` selects the call convention of a torchft ProcessGroup (``allreduce([t], op)``)
    instead of torch.distributed's functional API on a plain process group. ``fold`` is the
    deterministic mode's fixed order (a negative control swaps it).
    """
    if world_size == 1:
        return
    if deterministic:
        gathered = [torch.empty_like(tensor) for _ in range(world_size)]
        if torchft:
            group.allgather([gathered], [tensor], _opts_allgather()).wait()
        else:
            dist.all_gather(gathered, tensor, group=group)
        tensor.copy_(fold(gathered))
    elif torchft:
        group.allreduce([tensor], dist.ReduceOp.SUM).wait()
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
