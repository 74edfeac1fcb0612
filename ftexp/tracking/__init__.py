"""Tracking: per-run result files, sweep summaries, and wandb.

``track`` runs after the verdict. Curves always go to ``curves.png`` (no account needed); with
``tracking=wandb`` the same per-rollout metrics are logged as two wandb runs — baseline and
target — in one group per experiment, with the config and the verdict in each run's summary.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Any

from ftexp.config import TrackerKind


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def wandb_mode() -> str:
    """WANDB_MODE if the user set it; online only with a configured API key; else offline."""
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def experiment_group(run_dir: Path) -> str:
    """One group per experiment; a sweep point is named after its sweep (``<sweep>/<job>``)."""
    if run_dir.name.isdigit() and (run_dir.parent / "multirun.yaml").exists():
        return f"{run_dir.parent.name}/{run_dir.name}"
    return run_dir.name


def track(cfg, run_dir: Path, baseline: dict, target: dict, verdict) -> None:
    if cfg.tracking.name != TrackerKind.wandb:
        return
    import wandb

    group = experiment_group(run_dir)
    config = {k: _plain(getattr(cfg, k)) for k in ("mode", "scenario", "threshold", "trainer", "seed")}
    for side, series in (("baseline", baseline), ("target", target)):
        run = wandb.init(project=cfg.tracking.project, entity=cfg.tracking.entity, group=group, job_type=side,
                         name=f"{group}-{side}", dir=str(run_dir), config=config, mode=wandb_mode(),
                         reinit="create_new")
        steps = sorted({step for points in series.values() for step, _ in points})
        for step in steps:
            run.log({k: v for k, points in series.items() for s, v in points if s == step}, step=step)
        run.summary["verdict"] = "PASSED" if verdict.passed else "FAILED"
        run.summary["failed_checks"] = [c.name for c in verdict.checks if not c.passed]
        run.finish()
