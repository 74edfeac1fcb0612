"""Train the sides of a run, phase by phase: one submitit job per (side, phase).

The scenario says which sides train (a soak has no baseline); each job gets a ``JobSpec`` built
here from the config and the run dir. While a soak's target trains, the harness injects random
faults into it through its control server.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ftexp.config import ExperimentConfig, PhaseConfig
from ftexp.engines.registry import get_engine
from ftexp.faults.plan import FaultPlan
from ftexp.faults.soak import SoakInjection
from ftexp.job import JobSpec, RolloutInjection
from ftexp.launch.jobs import run_side_job
from ftexp.placement import placement_for
from ftexp.rundir import BASELINE, TARGET, rollout_data_dir, side_dir
from ftexp.scenarios import load_scenario
from ftexp.tasks.warmup import cached_warmup, warmup_key


def job_spec(cfg: ExperimentConfig, run_dir: Path, side: str, phase: PhaseConfig) -> JobSpec:
    """What the training job of ``side`` in ``phase`` runs; the fault plan and control plane are the target's."""
    target = side == TARGET
    soak = load_scenario(cfg.scenario).is_soak
    placement = placement_for(cfg)
    own_dir = side_dir(run_dir, side, phase.name)
    live = cfg.mode.rollout_num_engines > 0
    load_dir = side_dir(run_dir, side, phase.load_from).ckpt if phase.load_from is not None else None
    return JobSpec(
        side=side, phase=phase.name, side_dir=own_dir, data_dir=own_dir.rollout_data if live else rollout_data_dir(run_dir),
        trainer=cfg.trainer, mode=cfg.mode, num_rollout=cfg.scenario.num_rollout,
        plan=FaultPlan(phase.target_actions if target else [], cfg.mode.num_cells, placement),
        deterministic=cfg.scenario.deterministic, seed=cfg.seed,
        load_dir=load_dir,
        save_interval=phase.save_interval, exit_after_rollouts=phase.exit_after_rollouts,
        control=cfg.scenario.control if target and cfg.scenario.control.enabled else None,
        soak=cfg.scenario.soak if target and soak else None,
        placement=placement, cluster=cfg.launcher.ray if placement is not None else None,
        launcher=cfg.launcher if placement is not None else None,
        inject=_injection(cfg, run_dir, phase) if target else None,
        task=cfg.task if cfg.task.enabled else None,
        warmup_cached=_cached_warmup(cfg) if load_dir is None else None,
    )


def _cached_warmup(cfg: ExperimentConfig) -> Path | None:
    """The cache entry of this run's warm-up, if an earlier run left a complete one."""
    warmup = cfg.task.warmup
    if not (cfg.task.enabled and warmup.steps and warmup.cache_dir):
        return None
    key = warmup_key(cfg.mode, cfg.trainer, cfg.task, cfg.seed, cfg.scenario.deterministic)
    return cached_warmup(warmup.cache_dir, key, get_engine(cfg.trainer.engine).ranks_per_replica(cfg.mode))


def _injection(cfg: ExperimentConfig, run_dir: Path, phase: PhaseConfig) -> RolloutInjection | None:
    """A live-rollout mode with a match ratio: from the scripted heal on, train on the baseline's rollouts."""
    ratio = cfg.mode.rollout_inject_min_match_ratio
    if ratio is None or cfg.mode.rollout_num_engines == 0:
        return None
    heal = FaultPlan(phase.target_actions, cfg.mode.num_cells, placement_for(cfg)).first_heal_rollout()
    if heal is None:
        return None
    return RolloutInjection(data_dir=side_dir(run_dir, BASELINE, phase.name).rollout_data,
                            start_rollout_id=heal, min_match_ratio=ratio)


def train_sides(cfg: ExperimentConfig, run_dir: Path, sides: tuple[str, ...], only_phase: str | None) -> None:
    """Train ``sides`` (those the scenario trains) of every phase, or of ``only_phase``; raise JobFailed."""
    trained = [s for s in sides if s in load_scenario(cfg.scenario).sides]
    for phase in cfg.scenario.phases:
        if only_phase is not None and phase.name != only_phase:
            continue
        for side in trained:
            spec = job_spec(cfg, run_dir, side, phase)
            if spec.side_dir.root.exists():
                shutil.rmtree(spec.side_dir.root)  # a side's results are always from one fresh run
            spec.side_dir.root.mkdir(parents=True)
            if spec.soak is None:
                run_side_job(spec, cfg.launcher)
                continue
            injection = SoakInjection(spec.soak, cfg.seed, spec.side_dir)
            try:
                run_side_job(spec, cfg.launcher, on_poll=injection.poll)
            finally:
                injection.stop()
