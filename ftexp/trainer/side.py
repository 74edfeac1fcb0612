"""What one training job runs (a side of one phase) and where it writes.

A ``SideSpec`` is the whole contract between the pipeline and a training job: it is pickled into
the submitit job, and everything the job produces lands under ``side_dir``:

    side_dir/train.log  metrics.jsonl  events/<process>.jsonl  dumps/fwd_bwd/rollout_<id>/  ckpt/
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftexp.audit.events import read_events
from ftexp.audit.witness import persisted_counter
from ftexp.trainer.replica import latest_checkpoint

BASELINE, TARGET = "baseline", "target"


def side_dir(run_dir: Path, side: str, phase: str) -> Path:
    """``<run_dir>/<side>[/<phase>]``: where one training job of an experiment writes."""
    return run_dir / side / phase if phase else run_dir / side


@dataclass
class SideSpec:
    side: str                       # "baseline" (plain DP) or "target" (fault-tolerant cells)
    phase: str                      # "" for single-phase scenarios
    side_dir: Path
    data_dir: Path                  # recorded rollouts: <data_dir>/<rollout_id>.pt
    trainer: Any                    # ftexp.config.TrainerConfig (engine resolved)
    num_cells: int                  # DP size
    num_rollout: int                # exclusive end rollout id
    deterministic: bool = False
    seed: int = 1
    load_dir: Path | None = None    # resume from this ckpt root
    save_interval: int | None = None
    exit_after_rollouts: int | None = None
    actions: list[Any] = field(default_factory=list)  # ftexp.config.TestAction (target only)
    control: Any = None             # ftexp.config.ControlConfig (target only)
    soak: Any = None                # ftexp.config.SoakConfig (target only)
    mode: Any = None                # ftexp.config.ModeConfig: the parallel layout of a replica

    @property
    def events_dir(self) -> Path:
        return self.side_dir / "events"

    @property
    def dumps_dir(self) -> Path:
        return self.side_dir / "dumps"

    @property
    def ckpt_dir(self) -> Path:
        return self.side_dir / "ckpt"

    def dump_leaf(self, rollout_id: int) -> Path:
        return self.dumps_dir / "fwd_bwd" / f"rollout_{rollout_id}"

    def start_rollout_id(self) -> int:
        """0 on a cold start; the loaded checkpoint's rollout id + 1 on resume."""
        if self.load_dir is None:
            return 0
        loaded = latest_checkpoint(self.load_dir)
        if loaded is None:
            raise FileNotFoundError(f"no checkpoint to resume from in {self.load_dir}")
        return loaded + 1

    def rollout_ids(self) -> range:
        start = self.start_rollout_id()
        end = self.num_rollout
        if self.exit_after_rollouts is not None:
            end = min(end, start + self.exit_after_rollouts)
        return range(start, end)

    def should_save(self, rollout_id: int) -> bool:
        """Spec §5: at every ``save_interval``-th rollout and at the last one."""
        if self.save_interval is None:
            return False
        return rollout_id == self.num_rollout - 1 or (rollout_id + 1) % self.save_interval == 0


def append_metrics(side_dir: Path, rollout_id: int, attempt: int, metrics: dict[str, float]) -> None:
    with open(side_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": rollout_id, "attempt": attempt, **metrics}) + "\n")


def append_perf(side_dir: Path, rollout_id: int, step_time_s: float) -> None:
    """Wall time of one committed rollout as the side's loop saw it (for benchmarks, never compared)."""
    with open(side_dir / "perf.jsonl", "a") as f:
        f.write(json.dumps({"step": rollout_id, "step_time_s": step_time_s}) + "\n")


def snapshot_events(events_dir: Path, iter_dir: Path) -> None:
    """Copy the event dir into the checkpoint, so the audit trail survives resume (spec §5)."""
    dst = iter_dir / "debug_events"
    if dst.exists():
        shutil.rmtree(dst)
    if events_dir.is_dir():
        shutil.copytree(events_dir, dst)


def restore_events(load_dir: Path, events_dir: Path) -> None:
    """Start this run's event dir from the loaded checkpoint's snapshot, if it has one."""
    loaded = latest_checkpoint(load_dir)
    snap = load_dir / f"iter_{loaded:07d}" / "debug_events" if loaded is not None else None
    if snap is not None and snap.is_dir():
        if events_dir.exists():
            shutil.rmtree(events_dir)
        shutil.copytree(snap, events_dir)


def start_event_log(spec: SideSpec) -> int:
    """Set up the side's event dir; return the witness counter to continue from.

    On resume the dir is first replaced by the loaded checkpoint's snapshot, and only then is the
    counter read (spec §5, §17.8): allocations logged after that checkpoint never reached its
    weights, so their ids are free again, while every id the checkpoint's weights hold stays taken.
    """
    if spec.load_dir is not None:
        restore_events(spec.load_dir, spec.events_dir)
    return persisted_counter(read_events(spec.events_dir))
