"""The witness parameters in the model: which samples a step trained, readable from the weights.

A witness is an ``Embedding(buffer_size, 1)`` that starts at zero. Every token carries its sample's
witness id (``ftexp/audit/witness.py``). The forward adds ``w − w.detach()`` to the hidden states:
exactly zero, so no activation, loss or policy gradient changes by a single bit. Its backward gives
the witness row of each token ``Σ|∂L/∂hidden|`` over the feature dimension (the absolute value
stops positive and negative gradients from cancelling out). A row therefore receives a gradient
iff its sample contributed to the loss, and Adam turns that into a non-zero weight that stays
non-zero. A zero-advantage sample has zero gradient everywhere, so its row stays exactly 0.

Two instances sit in the model: ``local_head_witness`` after the embeddings and
``local_tail_witness`` after the final norm, before the output layer. They are ordinary parameters — they travel in heals and checkpoints and
are part of the weight checksums — but they are kept out of gradient clipping, so they cannot
change the clipping factor, and out of the tensor dumps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ftexp.audit.witness import IdRange


class _AddWitness(torch.autograd.Function):
    """A plain add forward; backward passes the hidden gradient through and gives the witness its L1 norm."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, witness: torch.Tensor) -> torch.Tensor:
        return hidden + witness

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.abs().sum(dim=-1, keepdim=True)


class Witness(nn.Module):
    """One witness instance: a scalar per witness slot (zeroed by ``build_model``)."""

    def __init__(self, buffer_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(buffer_size, 1))

    def forward(self, hidden: torch.Tensor, witness_ids: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, D], witness_ids [B, T] -> hidden, unchanged bit for bit."""
        w = F.embedding(witness_ids, self.weight)  # [B, T, 1]
        return _AddWitness.apply(hidden, w - w.detach())


def nonzero_witness_ranges(witness: Witness) -> list[IdRange]:
    """The ids of the non-zero rows, as sorted half-open [start, stop) runs of consecutive ids."""
    ids = torch.nonzero(witness.weight.detach().view(-1)).view(-1)
    if ids.numel() == 0:
        return []
    breaks = torch.nonzero(ids[1:] != ids[:-1] + 1).view(-1)  # a run ends at each break
    starts = torch.cat([ids[:1], ids[breaks + 1]])
    stops = torch.cat([ids[breaks] + 1, ids[-1:] + 1])
    return list(zip(starts.tolist(), stops.tolist()))


@torch.no_grad()
def zero_witness_rows(witness: Witness, optimizer: torch.optim.Optimizer, ranges: list[IdRange]) -> None:
    """Zero the rows of ``ranges`` in the weight and in Adam's moments, so a reused slot starts at 0."""
    state = optimizer.state.get(witness.weight)  # absent until the first step, unless made up front
    tensors = [witness.weight] + ([state["exp_avg"], state["exp_avg_sq"]] if state else [])
    for tensor in tensors:
        for start, stop in ranges:
            tensor[start:stop].zero_()
