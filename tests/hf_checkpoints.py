"""Tiny random Qwen3 / Qwen3-MoE HF checkpoints, written with transformers, for the policy-import tests.

Shaped unlike the presets on purpose: a head dim (16) that is not hidden / heads (48 / 4), RoPE base
1e6, RMSNorm epsilon 1e-6, norms scrambled away from 1 (so a misplaced norm shows). The tokenizer is
per character, like the ASCII one, but with permuted ids (``id = 5·code + 3 mod 128``), so text
tokenized the ASCII way instead of with the checkpoint's ``tokenizer.json`` gives other ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 128
EOS = "\x04"  # the answer's end, as in the ASCII tokenizer; its id here is 5·4 + 3 = 23


def token_id(char: str) -> int:
    return (5 * ord(char) + 3) % VOCAB


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({chr(c): token_id(chr(c)) for c in range(VOCAB)}, unk_token="\x1a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def write_checkpoint(directory: Path, moe: bool = False, seed: int = 0, **overrides) -> Path:
    """A random Qwen3 (or Qwen3-MoE: 4 experts, top 2) of 4 layers saved as an HF checkpoint in `directory`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    sizes = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
                 eos_token_id=token_id(EOS), tie_word_embeddings=False)
    torch.manual_seed(seed)
    if moe:
        config = Qwen3MoeConfig(**{**sizes, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
                                   "norm_topk_prob": True, **overrides})
        model = Qwen3MoeForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**{**sizes, "intermediate_size": 80, **overrides}))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    write_tokenizer(directory)
    return directory
