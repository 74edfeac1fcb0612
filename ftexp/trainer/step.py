"""The training step both sides run, whatever the engine: shard → forward/backward → reduce → step.

``train_step`` drives a replica (``ftexp.engines.base.Replica``) through one attempt of one
rollout. The side supplies the reduce: the baseline SUMs over its DP world, a cell over the other
alive cells; a reduce that fails voids the attempt and leaves no trace in weights or optimizer.

The step also keeps the witness audit trail: it logs each local sample's advantages with its
witness id, and after a committed step the non-zero witness rows, then zeroes the stale ones.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections import defaultdict
from typing import Callable

import torch

from ftexp.audit.events import EventLogger, MetricEvent, TrainAdvantageComputationEvent, WitnessSnapshotParamEvent
from ftexp.audit.witness import WitnessInfo
from ftexp.engines.base import Replica, draw_step_randomness
from ftexp.engines.grpo import make_train_batch, strided_shard, token_advantages
from ftexp.rundir import SideDir


class SectionTimer:
    """Seconds per named section of a step, for the benchmark's breakdown (never compared)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def section(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def breakdown(self, total_s: float, **measured: float) -> dict[str, float]:
        """The step's sections (these and ``measured`` elsewhere), ``compute_s`` (what they leave of ``total_s``)
        and ``total_s``."""
        seconds = dict(self.seconds, **measured)
        return dict(seconds, compute_s=total_s - sum(seconds.values()), total_s=total_s)


def settle_heap() -> None:
    """Keep the objects a rank's start-up made (imports, the model: ~350k) out of the garbage collector's sight.

    Otherwise the next full collection scans them all (0.1-0.4 s on this CPU), comes due in the first training
    steps, and stalls the rank while its peers wait for it in the reduce. Called once the rank is built; what it
    allocates from then on is collected as before."""
    gc.freeze()


def train_step(replica: Replica, rollout: dict, rollout_id: int, attempt: int, *, shard_rank: int, shard_size: int,
               witness: WitnessInfo | None, events: EventLogger, reduce: Callable[[torch.Tensor], bool],
               before_reduce: Callable[[], None] = lambda: None,
               on_commit: Callable[[], None] = lambda: None,
               timer: SectionTimer | None = None) -> tuple[bool, dict[str, float] | None]:
    """The step both sides run. ``reduce`` SUMs the flat buffer in place and says whether it worked.

    On failure the gradients are dropped and nothing is stepped, so a discarded attempt leaves no
    trace in weights, optimizer state or RNG generators (a commit draws once from each).
    ``on_commit`` runs after the reduce and before the optimizer step (that is where weights and
    reduced grads are dumped). ``witness`` (one id per sample of the rollout) is required exactly
    when the replica's model has witnesses. ``timer`` collects the witness bookkeeping's seconds.
    """
    timer = timer or SectionTimer()
    if (witness is not None) != replica.has_witness:
        raise ValueError("witness ids must be given exactly when the model has witnesses (trainer.enable_witness)")
    num_samples = len(rollout["samples"])
    batch = make_train_batch(rollout, strided_shard(num_samples, shard_rank, shard_size),
                             witness.witness_ids if witness is not None else None)
    if witness is not None:
        with timer.section("witness_s"):
            advantages, token_witness_ids = token_advantages(batch)
        events.log(TrainAdvantageComputationEvent(rollout_id=rollout_id, attempt=attempt, advantages=advantages,
                                                  witness_ids=token_witness_ids))
    replica.zero_grad()
    stats = replica.forward_backward_reduce(batch, num_samples, shard_size, before_reduce, reduce)
    if stats is None:
        replica.zero_grad()
        return False, None
    on_commit()
    grad_norm = replica.optimizer_step(rollout_id)
    draw_step_randomness()  # the generators move with every commit, as a sampling step would move them
    metrics = replica.metrics(stats, grad_norm, rollout)
    replica.zero_grad()
    if witness is not None:
        with timer.section("witness_s"):
            snapshot = replica.witness_snapshot()
        for instance, nonzero in snapshot.items():
            events.log(WitnessSnapshotParamEvent(rollout_id=rollout_id, attempt=attempt, instance_id=instance,
                                                 nonzero_witness_id_ranges=nonzero, stale_id_ranges=witness.stale_ranges))
        with timer.section("witness_s"):
            replica.zero_stale_witness_rows(witness.stale_ranges)
    return True, metrics


def record_metrics(side_dir: SideDir, events: EventLogger, rollout_id: int, attempt: int, metrics: dict[str, float]) -> None:
    """A committed step's metrics: a line of ``metrics.jsonl`` and a metric event (one writer per side)."""
    with open(side_dir.metrics, "a") as f:
        f.write(json.dumps({"step": rollout_id, "attempt": attempt, **metrics}) + "\n")
    events.log(MetricEvent(rollout_id=rollout_id, attempt=attempt, metrics=metrics))


def record_step_time(side_dir: SideDir, rollout_id: int, step_time_s: float, **sections: float) -> None:
    """Wall time of one committed rollout (for benchmarks, never compared): from the start of its training to
    every rank's commit. The target's is measured by the slowest cell's ranks from the previous commit, plus,
    for the first rollout of a train call, the driver's round trip around it (``TrainGroup.train``). Both
    sides leave the same things out: the log line, the rollout engines' update and the checkpoint save."""
    with open(side_dir.perf, "a") as f:
        f.write(json.dumps({"step": rollout_id, "step_time_s": step_time_s, **sections}) + "\n")


def record_sections(side_dir: SideDir, rollout_id: int, attempt: int, cell: int | None, rank: int,
                    seconds: dict[str, float]) -> None:
    """One rank's step breakdown (``step_sections.jsonl``, for benchmarks, never compared); ``cell`` None: a
    baseline rank, ``rank`` its global rank."""
    with open(side_dir.step_sections, "a") as f:
        f.write(json.dumps({"step": rollout_id, "attempt": attempt, "cell": cell, "rank": rank, **seconds}) + "\n")
