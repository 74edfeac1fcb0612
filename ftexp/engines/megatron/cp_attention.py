"""Causal core attention with context parallelism, without Transformer Engine.

Under context parallelism (CP) Megatron splits every sequence into 2·cp chunks and gives CP rank r
chunks r and 2·cp−1−r (`get_batch_on_this_cp_rank`), which balances the causal workload. Its own
CP attention exists only in Transformer Engine; the local `DotProductAttention` refuses CP > 1.

`ContextParallelAttention` is a drop-in `core_attention` for a local layer spec: each rank
all-gathers K and V over the CP group (backward reduce-scatters their grads, so every rank's
queries contribute to every chunk's K/V grads), puts the chunks back into sequence order, and
attends its local queries to the whole sequence under a causal mask built from global positions.
Memory is O(local queries × full sequence) — fine for the tiny models it serves; it is a
correctness reference, not a ring-attention kernel.
"""

from __future__ import annotations

import math

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


def chunk_order(cp_size: int) -> list[int]:
    """Chunk ids in the order the CP all-gather delivers them (rank r holds r, then 2·cp−1−r)."""
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def local_positions(seq_len_local: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token positions of this CP rank's local sequence (its two chunks, concatenated)."""
    chunk = seq_len_local // 2
    firsts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(first, first + chunk, device=device) for first in firsts])


class ContextParallelAttention(MegatronModule):
    """Causal softmax attention over the full sequence for CP-split queries; same I/O as DotProductAttention."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"ContextParallelAttention supports causal masks only, got {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError("ContextParallelAttention has no attention dropout; set attention_dropout=0")
        if pg_collection is None:  # Megatron's Attention passes its groups; standalone use takes the global ones
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        tp_size = pg_collection.tp.size()
        self.heads_per_partition = config.num_attention_heads // tp_size
        self.query_groups_per_partition = config.num_query_groups // tp_size
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [sq, b, heads, d], key/value [sq, b, groups, d] (local) -> context [sq, b, heads·d]."""
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise ValueError("ContextParallelAttention takes no explicit mask, bias or packed sequences")
        cp_size = self.cp_group.size()
        seq_local, batch = query.shape[0], query.shape[1]
        if seq_local % 2:
            raise ValueError(f"local sequence length {seq_local} is not two CP chunks")

        key = self._full_sequence(key, cp_size)
        value = self._full_sequence(value, cp_size)
        repeat = self.heads_per_partition // self.query_groups_per_partition
        if repeat > 1:  # grouped-query attention: each K/V group serves `repeat` query heads
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)

        q_pos = local_positions(seq_local, cp_size, self.cp_group.rank(), device=query.device)
        k_pos = torch.arange(key.shape[0], device=query.device)
        future = k_pos[None, :] > q_pos[:, None]  # [sq, sk]

        scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * self.softmax_scale
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(value.dtype)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value)
        return context.reshape(seq_local, batch, self.heads_per_partition * self.head_dim)

    def _full_sequence(self, local: torch.Tensor, cp_size: int) -> torch.Tensor:
        """All-gather this rank's two chunks from every CP rank and restore sequence order."""
        gathered = gather_from_sequence_parallel_region(local, tensor_parallel_output_grad=True, group=self.cp_group)
        chunks = gathered.chunk(2 * cp_size, dim=0)
        by_chunk_id = dict(zip(chunk_order(cp_size), chunks))
        return torch.cat([by_chunk_id[i] for i in range(2 * cp_size)], dim=0)
