"""Train one Megatron layout on N gloo ranks (127.0.0.1) and collect what a comparison needs.

A layout is a ``ftexp.config.ModeConfig`` (its tp, pp, cp, ep, etp, sequence_parallel and
pipeline split; the rest of the world is data parallel). Each spawned rank builds its shard,
optionally loads an unsplit model's weights, trains a few optimizer steps on its data-parallel
share of a fixed global batch (`megatron_training`), and saves its losses, reduced grads (before
each step) and weights (after each step) keyed by global parameter name, plus its step times and
peak RSS. `run_layout` reassembles the TP shards into full tensors. A `rank_setup` function (picklable:
defined at a module's top level) runs on every rank before the model is built, e.g. to plant a bug.

Also a command line for measurements:
    python tests/engines/megatron/megatron_harness.py tiny_dense '{"tp": 2}' --world 2 --steps 10
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from loopback_world import join_world, rendezvous_port, spawn_ranks

GLOBAL_MICROBATCHES = 2  # the global batch: split over DP ranks, run as microbatches within a rank
DATA_SEED = 7
# Adam divides each grad element by its own magnitude plus eps: with the usual 1e-8, an element
# whose grad is ~1e-8 turns float32 rounding noise into update differences of ~lr/100. A larger
# eps keeps the update a well-conditioned function of the grads, so equal grads mean equal weights.
ADAM_EPS = 1e-6


@dataclass
class LayoutRun:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, full (TP-assembled) by global name; [] under DistOpt
    weights: list[dict[str, torch.Tensor]]  # after each step
    step_seconds: list[list[float]]  # per rank
    peak_rss_mb: list[float]  # per rank


def _quiet_expected_warnings():
    """Silence what every CPU rank prints on import: no TE/Apex fallbacks, deprecated torch names."""
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex are|is) not installed")
    warnings.filterwarnings("ignore", message="full scope is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning, message="`torch.distributed.")


def _worker(rank, world, port, preset, mode, steps, out_dir, init_path, distributed_optimizer, rank_setup):
    _quiet_expected_warnings()
    torch.set_num_threads(1)  # N ranks share few cores; more threads only oversubscribe them
    join_world(rank, world, port)
    if rank_setup is not None:
        rank_setup()
    from megatron.core import parallel_state

    import megatron_training as mt

    from ftexp.engines.megatron import model as mg

    model = mg.build_gpt(preset, mode)
    if init_path is not None:
        mt.load_full_state(model, torch.load(init_path))
    initial = mt.local_shards(model)
    ddp_model, optimizer = mg.wrap_for_training(model, adam_eps=ADAM_EPS, distributed_optimizer=distributed_optimizer)

    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    microbatches = mt.synthetic_microbatches(preset, GLOBAL_MICROBATCHES, seed=DATA_SEED)[dp_rank::dp_size]
    losses, grads, weights, seconds = [], [], [], []

    def record_grads(m):
        grads.append(mt.local_shards(m, grads=True))

    for _ in range(steps):
        start = time.perf_counter()
        on_grads = None if distributed_optimizer else record_grads  # see run_layout
        losses.append(mt.train_step(ddp_model, optimizer, microbatches, on_grads=on_grads).loss)
        seconds.append(time.perf_counter() - start)
        weights.append(mt.local_shards(ddp_model))
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    torch.save(
        dict(initial=initial, losses=losses, grads=grads, weights=weights, seconds=seconds, peak_rss_mb=peak_rss_mb),
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's shards; replicas of one shard must agree."""
    from megatron_training import assemble_full

    collected: dict[str, dict[int, tuple]] = {}
    for shards in per_rank:
        for name, (tensor, info) in shards.items():
            seen = collected.setdefault(name, {}).setdefault(info.tp_rank, (tensor, info))
            if not torch.allclose(seen[0], tensor, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"replicas of {name} (tp rank {info.tp_rank}) disagree")
    return {name: assemble_full(list(by_rank.values())) for name, by_rank in collected.items()}


def run_layout(
    preset: str, mode, world: int, steps: int, out_dir: Path, init_state: Path | None = None,
    distributed_optimizer: bool = False, rank_setup=None,
) -> LayoutRun:
    """Spawn `world` ranks for `mode`'s layout; with `init_state`, start from those full weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    args = (world, rendezvous_port(), preset, mode, steps, str(out_dir), init_state, distributed_optimizer, rank_setup)
    spawn_ranks(_worker, args=args, nprocs=world)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
    if init_state is None:
        torch.save(_assemble([r["initial"] for r in ranks]), out_dir / "initial.pt")
    return LayoutRun(
        losses=ranks[0]["losses"],
        # The distributed optimizer reduce-scatters grads: each DP rank's buffer is right only in
        # the slice it owns, so there are no full grads to assemble (losses and weights still are).
        grads=[_assemble([r["grads"][s] for r in ranks]) for s in range(len(ranks[0]["grads"]))],
        weights=[_assemble([r["weights"][s] for r in ranks]) for s in range(steps)],
        step_seconds=[r["seconds"] for r in ranks],
        peak_rss_mb=[r["peak_rss_mb"] for r in ranks],
    )


def _main(argv):
    import argparse
    import tempfile

    from ftexp.config import ModeConfig

    parser = argparse.ArgumentParser(description="time one layout")
    parser.add_argument("preset")
    parser.add_argument("layout", help='JSON ModeConfig fields, e.g. {"tp": 2, "sequence_parallel": true}')
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        mode = ModeConfig(**{"name": "cli", "num_cells": 1, **json.loads(args.layout)})
        run = run_layout(args.preset, mode, args.world, args.steps, Path(tmp))
        total = time.perf_counter() - start
    steady = [sorted(s[1:])[len(s[1:]) // 2] for s in run.step_seconds]  # median, first step excluded
    print(json.dumps(dict(
        preset=args.preset, layout=json.loads(args.layout), world=args.world, wall_s=round(total, 1),
        first_step_s=[round(s[0], 3) for s in run.step_seconds], median_step_s=[round(s, 3) for s in steady],
        peak_rss_mb=[round(m) for m in run.peak_rss_mb], losses=[round(x, 5) for x in run.losses],
    )))


if __name__ == "__main__":
    _main(sys.argv[1:])
