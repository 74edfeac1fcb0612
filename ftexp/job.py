"""What one training job runs: a side of one phase, as the typed spec the pipeline hands to a job.

A ``JobSpec`` is the whole contract between the pipeline and a training job: it is pickled into
the submitit job, everything the job reads is named by it, and everything it produces lands under
``side_dir`` (see ``ftexp.rundir``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftexp.config import ControlConfig, LauncherConfig, ModeConfig, RayClusterConfig, SoakConfig, TaskConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan
from ftexp.placement import Placement
from ftexp.rundir import SideDir, latest_checkpoint


@dataclass(frozen=True)
class RolloutInjection:
    """Live rollouts from ``start_rollout_id`` on are generated, checked against another run's recorded
    rollouts (``data_dir``) and replaced by them, so training after a fault sees the same data."""

    data_dir: Path
    start_rollout_id: int
    min_match_ratio: float              # the mean response-token match ratio must be strictly above it


@dataclass
class JobSpec:
    side: str                       # "baseline" (plain DP) or "target" (fault-tolerant cells)
    phase: str                      # "" for single-phase scenarios
    side_dir: SideDir
    data_dir: Path                  # the rollouts it trains on: <data_dir>/<rollout_id>.pt (live: it writes them)
    trainer: TrainerConfig          # engine and witness already resolved by ftexp.validate
    mode: ModeConfig                # the parallel layout of a replica and the number of cells
    num_rollout: int                # exclusive end rollout id
    plan: FaultPlan                 # the scripted faults (empty on the baseline)
    deterministic: bool = False
    seed: int = 1
    load_dir: Path | None = None    # resume from this ckpt root
    save_interval: int | None = None
    exit_after_rollouts: int | None = None
    control: ControlConfig | None = None  # the control plane (target only, when enabled)
    soak: SoakConfig | None = None        # set only when the scenario is a soak (target only)
    placement: Placement | None = None    # multi-node jobs: which node each rank runs on (None: one node)
    cluster: RayClusterConfig | None = None  # multi-node jobs: how the nodes' Ray cluster forms
    launcher: LauncherConfig | None = None   # multi-node jobs: where a replacement node is submitted
    inject: RolloutInjection | None = None   # live rollouts replaced by recorded ones (target, after a fault)
    task: TaskConfig | None = None           # live rollouts: the task's prompts, reward, warm-up and eval (None: none)
    warmup_cached: Path | None = None        # the task's warm-up, already computed: a cache entry every rank loads

    @property
    def live_rollout(self) -> bool:
        """Rollouts come from live engines fed with this side's weights, not from recorded files."""
        return self.mode.rollout_num_engines > 0

    @property
    def nodes(self) -> int:
        return self.placement.nodes if self.placement is not None else 1

    @property
    def num_cells(self) -> int:
        """The DP size: cells of the target, data-parallel replicas of the baseline."""
        return self.mode.num_cells

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
        """At every ``save_interval``-th rollout and at the last one."""
        if self.save_interval is None:
            return False
        return rollout_id == self.num_rollout - 1 or (rollout_id + 1) % self.save_interval == 0
