"""Can this cluster run the mode? Checked at launch, after the config is valid, before any job starts.

A mode names what it needs (train nodes, rollout engines); a local launcher is one
node, a Slurm launcher has the nodes ``sinfo`` reports, and a multi-node job's cells must fit its
train nodes, its rollout engines getting nodes of their own (``ftexp.placement``). What cannot run
here is refused with one line (exit 2) naming every reason, instead of failing deep inside a rank.
"""

from __future__ import annotations

import shutil
import subprocess

from ftexp.config import ExperimentConfig, LauncherKind, RolloutBackend
from ftexp.errors import InputError
from ftexp.placement import nodes_wanted, placement_for, rollout_nodes_of


def available_nodes(cfg: ExperimentConfig) -> int:
    if cfg.launcher.name == LauncherKind.local or shutil.which("sinfo") is None:
        return 1
    args = ["sinfo", "-h", "-o", "%D"] + (["-p", cfg.launcher.partition] if cfg.launcher.partition else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    return sum(int(x) for x in out.split() if x.isdigit()) or 1


def check_capacity(cfg: ExperimentConfig) -> None:
    """Everything this cluster cannot give the mode, in one line (exit 2), before any job starts."""
    mode, launcher = cfg.mode, cfg.launcher
    if launcher.nodes > 1 and launcher.name != LauncherKind.slurm:
        raise InputError(f"launcher.nodes={launcher.nodes} needs launcher=slurm (launcher={launcher.name.value} "
                         f"is this one machine)")
    reasons = []
    nodes = nodes_wanted(mode, launcher.nodes)
    rollout_nodes = rollout_nodes_of(mode) if nodes > 1 else 0
    wanted = (f"{nodes} nodes, {nodes - rollout_nodes} train + {rollout_nodes} rollout" if rollout_nodes
              else f"{nodes} train nodes")
    if nodes > 1:
        have = available_nodes(cfg)
        if launcher.name == LauncherKind.local:
            reasons.append(f"{wanted} (launcher=local is one machine: use launcher=slurm)")
        elif nodes > have:
            reasons.append(f"{wanted} (launcher=slurm has {have})")
        else:
            try:
                placement_for(cfg)  # the cells must fit the nodes
            except InputError as e:
                reasons.append(f"its cells placed on {nodes} nodes: {e}")
    if mode.rollout_num_engines:
        if rollout_nodes and cfg.trainer.rollout.backend != RolloutBackend.cpu:
            reasons.append(f"rollout.backend={cfg.trainer.rollout.backend.value} engines on rollout nodes (sglang "
                           f"servers start beside the driver; starting them on rollout nodes is not built yet)")
        if mode.colocate:
            reasons.append("rollout engines colocated with the trainer (offloading between them is not built yet)")
    if reasons:
        raise InputError(f"mode {mode.name} needs " + "; and ".join(reasons))
