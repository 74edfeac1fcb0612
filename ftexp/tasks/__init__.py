"""Tasks with verifiable rewards: the prompts of live rollouts, their reward, and the eval accuracy.

``build_task`` turns ``task=...`` (``ftexp.config.TaskConfig``) into a ``Task`` (``tasks.base``), or None for
``task=none``, where live rollouts keep their random prompts and the ``deterministic_random`` reward.
"""

from __future__ import annotations

from pathlib import Path

from ftexp.config import TaskConfig, TaskName
from ftexp.tasks.base import Task


def build_task(cfg: TaskConfig) -> Task | None:
    if cfg.name == TaskName.none:
        return None
    if cfg.name == TaskName.arith:
        from ftexp.tasks.arith import ArithTask

        return ArithTask(cfg.dataset_seed, cfg.eval_size, cfg.terms, cfg.digits)
    from ftexp.tasks.gsm import Gsm8kTask, GsmSymbolicTask

    if cfg.name == TaskName.gsm_symbolic:
        return GsmSymbolicTask(cfg.dataset_seed, cfg.eval_size)
    return Gsm8kTask(Path(cfg.data_path), Path(cfg.eval_path) if cfg.eval_path else None, cfg.dataset_seed,
                     cfg.eval_size)
