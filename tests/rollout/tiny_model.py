"""A tiny Qwen3 for the rollout tests: its directory (config + ASCII tokenizer, no weights), a prompt, weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ftexp.rollout.tokenizer import write_ascii_tokenizer

PROMPT = [ord(c) for c in "12+7="]


def write_tiny_qwen3(directory: Path) -> Path:
    """Qwen3 with vocab 128, hidden 64, 2 layers, 4 heads (2 KV heads) of 16: 139k parameters, 0.56 MB."""
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256).save_pretrained(directory)
    write_ascii_tokenizer(directory)
    return directory


def random_weights(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, dtype=dtype) * 0.1 for name, (shape, dtype) in shapes.items()}


def write_tiny_qwen3_moe(directory: Path) -> Path:
    """Qwen3-MoE with 4 experts (top 2) per layer, otherwise like `write_tiny_qwen3`."""
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=256).save_pretrained(directory)
    write_ascii_tokenizer(directory)
    return directory
