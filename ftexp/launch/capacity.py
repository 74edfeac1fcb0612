"""Can this cluster run the mode? Checked at launch, after the config is valid, before any job starts.

A mode names what it needs (train nodes, rollout engines, expert-TP); a local launcher is one
node, a Slurm launcher has the nodes ``sinfo`` reports. What cannot run here is refused with one
line (exit 2) instead of failing deep inside a rank.
"""

from __future__ import annotations

import shutil
import subprocess

import torch

from ftexp.config import ExperimentConfig, LauncherKind
from ftexp.errors import InputError


def available_nodes(cfg: ExperimentConfig) -> int:
    if cfg.launcher.name == LauncherKind.local or shutil.which("sinfo") is None:
        return 1
    args = ["sinfo", "-h", "-o", "%D"] + (["-p", cfg.launcher.partition] if cfg.launcher.partition else [])
    out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    return sum(int(x) for x in out.split() if x.isdigit()) or 1


def check_capacity(cfg: ExperimentConfig) -> None:
    mode = cfg.mode
    if mode.nodes > 1:
        rollout_nodes = 0
        if mode.rollout_num_engines and not mode.colocate and mode.train_gpus_per_node:
            rollout_nodes = -(-mode.rollout_num_engines * mode.rollout_gpus_per_engine // mode.train_gpus_per_node)
        have = available_nodes(cfg)
        if mode.nodes + rollout_nodes > have:
            raise InputError(f"mode {mode.name} needs {mode.nodes} train nodes + {rollout_nodes} rollout nodes; "
                             f"launcher={cfg.launcher.name.value} has {have}")
    if mode.rollout_num_engines:
        raise InputError(f"mode {mode.name} needs {mode.rollout_num_engines} rollout engines; ftexp trains on "
                         f"recorded rollouts only (rollout engines are not built yet)")
    if mode.etp > 1 and not torch.cuda.is_available():
        raise InputError(f"mode {mode.name}: expert-TP {mode.etp} needs unevenly sized all-gathers, which gloo "
                         f"cannot do on CPU (set mode.etp=1)")
