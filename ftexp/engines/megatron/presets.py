"""Model presets of the megatron engine: CPU-scale stand-ins for the seed's models (no megatron import)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTPreset:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    seq_length: int
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0


PRESETS = {
    "tiny_dense": GPTPreset(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, vocab_size=128, seq_length=64,
    ),
    # Shaped like Qwen3-30B-A3B-5layer: every layer MoE, top-2 routing, GQA, qk-layernorm.
    "tiny_moe_5layer": GPTPreset(
        num_layers=5, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=32, vocab_size=128, seq_length=64,
        num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
    ),
}
