"""Calibration: how far bf16 noise moves ``rel`` and ``norm_ratio`` between two DP layouts.

The seed's dump rules (``rel <= 0.0085``) are calibrated for bf16 GPU kernels; CPU runs here are
fp32 (noise ~1e-11). This emulates the bf16 case on the CPU: the torch engine's TinyGPT computes
in bf16 (fp32 master weights and fp32 grad reduction, as Megatron's mixed precision does), on the
same batch split into 1, 2 or 4 data-parallel shards of 32-sample microbatches, for a few Adam
steps; each layout's grads and weights are compared with the 2-shard one (the "baseline") by
``tensor_diff``. A uniform scale error is printed next to it for contrast.

    python bench/bf16_noise.py                  # the CPU model (d_model 32) and a wider one (256)
"""

from __future__ import annotations

import argparse

import torch

from ftexp.config import ModelConfig
from ftexp.engines.torch.model import build_model, token_log_probs
from ftexp.verify.tensor_diff import tensor_diff


def train(cfg: ModelConfig, tokens: torch.Tensor, adv: torch.Tensor, shards: int, steps: int, micro: int = 32):
    """Per step: (weights, grads) before the optimizer step, by parameter name."""
    master = build_model(cfg)
    opt = torch.optim.Adam(master.parameters(), lr=1e-3, betas=(0.9, 0.98))
    out = []
    for step in range(steps):
        work = build_model(cfg).to(torch.bfloat16)
        work.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
        grads = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
        batch = tokens[step]
        n = batch.shape[0]
        for s in range(shards):  # each shard's grads in fp32, summed in fp32 (the cross-cell reduce)
            idx = torch.arange(s, n, shards)
            for m in range(0, len(idx), micro):
                part = idx[m:m + micro]
                work.zero_grad()
                logp = token_log_probs(work, batch[part])
                loss = -(adv[step][part].to(torch.bfloat16).unsqueeze(1) * logp).sum() / (n * logp.shape[1])
                loss.backward()
                for name, p in work.named_parameters():
                    grads[name] += p.grad.float()
        out.append(({k: v.detach().clone() for k, v in master.named_parameters()}, grads))
        for name, p in master.named_parameters():
            p.grad = grads[name]
        opt.step()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    for width in args.widths:
        cfg = ModelConfig(vocab_size=128, d_model=width, n_layers=2, n_heads=4, max_seq_len=24)
        tokens = torch.randint(0, cfg.vocab_size, (args.steps, args.batch, 24))
        adv = torch.randn(args.steps, args.batch)
        runs = {k: train(cfg, tokens, adv, k, args.steps) for k in (1, 2, 4)}
        for shards in (1, 4):
            for kind, i in (("grad", 1), ("weight", 0)):
                diffs = [(tensor_diff(b, runs[shards][step][i][name]), f"{kind}__{name}@{step} n={b.numel()}")
                         for step in range(args.steps) for name, b in runs[2][step][i].items()]
                rel = max(diffs, key=lambda d: d[0].rel)
                # The noise the seed's rule accepts: how far does it move the norm?
                accepted = [d for d in diffs if d[0].rel <= 0.0085]
                norm = max(accepted, key=lambda d: d[0].norm_ratio)
                big = max((d[0].norm_ratio for d in accepted if int(d[1].rsplit("n=", 1)[1]) >= 1024), default=0.0)
                print(f"d_model={width} {kind}s, {shards} vs 2 shards: worst rel {rel[0].rel:.3g} ({rel[1]}); "
                      f"{len(accepted)}/{len(diffs)} within rel <= 0.0085, their worst norm_ratio "
                      f"{norm[0].norm_ratio:.3g} ({norm[1]}, rel {norm[0].rel:.3g}), {big:.3g} over tensors of >= 1024")
        g = runs[2][0][1]["layers.0.mlp.fc1.weight"]
        for scale in (0.99, 0.98, 0.97, 0.5):
            d = tensor_diff(g, g * scale)
            print(f"  scale {scale}: rel {d.rel:.3g}, norm_ratio {d.norm_ratio:.3g}")


if __name__ == "__main__":
    main()
