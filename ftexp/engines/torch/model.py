"""TinyGPT: the small decoder-only transformer that every trainer process builds.

The baseline (plain data parallelism) and the fault-tolerant cells must start from the same
weights and compute the same bits, so the model is deliberately plain: pre-LayerNorm blocks,
explicit softmax attention (no SDPA/flash kernels, whose backends may pick different
algorithms), no dropout, and an init drawn from a local generator seeded by the config, so
that building the model neither depends on nor disturbs the global RNG. The trainers build it with
two witnesses (``witness.py``), which change no bit of the policy's forward or gradients.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import nn

from ftexp.config import ModelConfig
from ftexp.errors import InputError
from ftexp.engines.torch.witness import Witness

INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        head_dim = d_model // self.n_heads
        # [B, T, 3, H, Dh] -> three tensors of [B, H, T, Dh]
        q, k, v = self.qkv(x).view(batch, seq_len, 3, self.n_heads, head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        heads = weights @ v
        return self.proj(heads.transpose(1, 2).reshape(batch, seq_len, d_model))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    """Build it with :func:`build_model`, which gives it its seeded weights."""

    def __init__(self, cfg: ModelConfig, witness_buffer_size: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Registered last, so the policy's parameters keep their names and order.
        with_witness = witness_buffer_size is not None
        self.local_head_witness = Witness(witness_buffer_size) if with_witness else None
        self.local_tail_witness = Witness(witness_buffer_size) if with_witness else None

    def witnesses(self) -> dict[str, Witness]:
        """Witness instances by the id the witness events use; empty for a model without them."""
        if self.local_head_witness is None:
            return {}
        # One model chunk on pipeline stage 0, named like the reference's Megatron instances.
        return {"pp0_chunk0.local_head": self.local_head_witness, "pp0_chunk0.local_tail": self.local_tail_witness}

    def forward(self, tokens: torch.Tensor, witness_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: LongTensor [B, T] -> logits [B, T, vocab_size].

        ``witness_ids`` [B, T] (each token's sample's witness id) routes the tokens through the
        witnesses; without it (e.g. when sampling rollouts) they are left out.
        """
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise InputError(f"sequence length {seq_len} exceeds max_seq_len={self.cfg.max_seq_len}")
        if witness_ids is not None and self.local_head_witness is None:
            raise InputError("witness ids given to a model built without witnesses")
        positions = torch.arange(seq_len, device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(positions)
        if witness_ids is not None:
            x = self.local_head_witness(x, witness_ids)
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x)
        if witness_ids is not None:
            x = self.local_tail_witness(x, witness_ids)
        return self.lm_head(x)


def build_model(cfg: ModelConfig, witness_buffer_size: int | None = None) -> TinyGPT:
    """Build a TinyGPT whose weights depend only on ``cfg`` (identical in every process).

    With ``witness_buffer_size`` it also holds the two witnesses, zero-initialised; they draw
    nothing from the generator, so the policy's weights are the same with or without them.
    """
    # The modules' default init draws from the global RNG: fork it, so building a model leaves the
    # process's RNG as it was; every parameter is then filled from the local seeded generator.
    # (Not the meta device: its init path imports torch's compiler stack, a second of CPU per process.)
    with torch.random.fork_rng(devices=[]):
        model = TinyGPT(cfg, witness_buffer_size)
    generator = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Witness):
                module.weight.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, INIT_STD, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
    return model


def next_token_log_softmax(model: TinyGPT, tokens: torch.Tensor,
                           witness_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Log-distribution over the next token at each position but the last: [B, T-1, V].

    ``witness_ids`` [B]: each sample's witness id, given to every token it feeds.
    """
    # The last position predicts past the end of the sequence, so it is not fed at all.
    fed = tokens[:, :-1]
    token_witness_ids = witness_ids.unsqueeze(1).expand_as(fed) if witness_ids is not None else None
    return F.log_softmax(model(fed, token_witness_ids), dim=-1)


def gather_targets(log_softmax: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Pick the log-prob of each actual next token out of [B, T-1, V] -> [B, T-1]."""
    return log_softmax.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def token_log_probs(model: TinyGPT, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token under ``model``: tokens [B, T] -> [B, T-1]."""
    return gather_targets(next_token_log_softmax(model, tokens), tokens)
