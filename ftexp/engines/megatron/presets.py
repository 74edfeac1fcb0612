"""Model presets of the megatron engine: CPU-scale stand-ins for the seed's models (no megatron import).

A `GPTPreset` is everything the engine needs to build a GPT of the Qwen3 architecture (RMSNorm,
QK-norm, SwiGLU, GQA, RoPE, untied or tied embeddings; every layer MoE when it has experts). `PRESETS`
are the named CPU models; ``hf_import.HFCheckpoint`` derives one from a checkpoint's ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTPreset:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int  # of every expert when the model has experts (every layer is MoE)
    vocab_size: int
    seq_length: int
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_aux_loss_coeff: float = 0.0
    head_dim: int | None = None          # None: hidden_size // num_attention_heads
    rotary_base: float = 10000.0         # GPTModel's default RoPE base
    layernorm_epsilon: float = 1e-5      # TransformerConfig's default
    # Experts weighted by the softmax over all of them (HF norm_topk_prob=false), not renormalised over the top k.
    moe_router_pre_softmax: bool = False
    # The output layer is the input embedding (HF tie_word_embeddings; Qwen3-0.6B to 4B).
    tie_embeddings: bool = False

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


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
    # tiny_moe_5layer four times wider (~15x its bytes): a state large enough that a heal's transfer
    # is mostly bytes, not per-message costs (bench/step_time.py --large).
    "wide_moe_5layer": GPTPreset(
        num_layers=5, hidden_size=256, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, vocab_size=512, seq_length=64,
        num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2,
    ),
}
