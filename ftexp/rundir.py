"""Every path of a run directory: the contract between the trainer, the verifier and the trackers.

A run is one directory (Hydra's run dir)::

    <run_dir>/
      report.md  report.json  result.json  curves.png   the verdict, every check, the sweep's one-line facts
      submission.json  submitit_run/                     launcher.wait=false: the job that trains the run
      rollout_data/<id>.pt                               rollouts recorded once; both sides train on them
      <side>/[<phase>/]                                  side ∈ baseline, target; phase "" or phase_a/phase_b
        train.log  submitit/                             the training job's output and submitit's files
        rollout_data/<id>.pt                             live rollout engines: the rollouts this side trained on
        engines/model/                                   live rollout engines: HF config + tokenizer they start from
        warmup/rank<r>.pt                                a task's warm-up: the first cell's state, which the others load
        metrics.jsonl  perf.jsonl  step_sections.jsonl   committed metrics; step wall times and their breakdown (benchmarks only)
        events/<process>.jsonl                           typed events, one file per process
        dumps/fwd_bwd/rollout_<id>/                      weights and reduced grads of every rollout (the
                                                         baseline's replica 0; the target's first alive cell)
        cell_dumps/cell<i>/fwd_bwd/rollout_<id>/         target only: the same of every other alive cell i, in a new quorum
        ckpt/latest_checkpointed_iteration.txt           the id of the last complete checkpoint
        ckpt/iter_<id:07d>/state_pp<p>_tp<t>_cp<c>_ep<e>.pt   one file per rank of a replica
        ckpt/iter_<id:07d>/debug_events/                 the event log as of that checkpoint
        control.json  injections.json                    soak only: the control server's address; what was injected

Nothing else in ftexp spells these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BASELINE, TARGET = "baseline", "target"

REPORT_MD, REPORT_JSON, RESULT_FILE, CURVES = "report.md", "report.json", "result.json", "curves.png"
VERDICT_FILES = (REPORT_MD, REPORT_JSON, RESULT_FILE, CURVES)
SUBMISSION, SUBMITIT_RUN = "submission.json", "submitit_run"
CONTROL_FILE, INJECTIONS_FILE = "control.json", "injections.json"
METRICS_FILE = "metrics.jsonl"


def rollout_data_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "rollout_data"


def rollout_path(data_dir: str | Path, rollout_id: int) -> Path:
    return Path(data_dir) / f"{rollout_id}.pt"


@dataclass(frozen=True)
class SideDir:
    """Where one training job (a side of one phase) writes."""

    root: Path

    @property
    def train_log(self) -> Path:
        return self.root / "train.log"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def perf(self) -> Path:
        return self.root / "perf.jsonl"

    @property
    def step_sections(self) -> Path:
        return self.root / "step_sections.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events"

    @property
    def rollout_data(self) -> Path:
        """Live rollout engines: what this side generated and trained on, one file per rollout."""
        return rollout_data_dir(self.root)

    @property
    def engine_model(self) -> Path:
        """Live rollout engines: the HF config and tokenizer every engine (and the router) loads."""
        return self.root / "engines" / "model"

    @property
    def warmup(self) -> Path:
        """A task's warm-up: each rank's warmed-up state, written by the first cell for the others."""
        return self.root / "warmup"

    @property
    def dumps(self) -> Path:
        return self.root / "dumps"

    def dump_leaf(self, rollout_id: int) -> Path:
        return self.dumps / dump_leaf_name(rollout_id)

    def cell_dumps(self, cell_index: int) -> Path:
        """The target's dump root of cell ``cell_index`` for the rollouts it commits but does not
        write to ``dumps`` (that is the first alive cell's job): leaves as under ``dumps``."""
        return self.root / "cell_dumps" / f"cell{cell_index}"

    def cell_dump_leaf(self, cell_index: int, rollout_id: int) -> Path:
        return self.cell_dumps(cell_index) / dump_leaf_name(rollout_id)

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def control_file(self) -> Path:
        return self.root / CONTROL_FILE

    @property
    def cluster(self) -> Path:
        """Where the tasks of a multi-node job meet (``ftexp.faults.nodes``)."""
        return self.root / "cluster"

    @property
    def injections(self) -> Path:
        return self.root / INJECTIONS_FILE


def side_dir(run_dir: Path, side: str, phase: str) -> SideDir:
    """``<run_dir>/<side>[/<phase>]``: where one training job of an experiment writes."""
    return SideDir(Path(run_dir) / side / phase if phase else Path(run_dir) / side)


def dump_leaf_name(rollout_id: int) -> str:
    """A leaf's path relative to a dumps root, as the comparison lists them."""
    return f"fwd_bwd/rollout_{rollout_id}"


# ---- checkpoints ---------------------------------------------------------------------------------
TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(ckpt_root: Path, rollout_id: int) -> Path:
    return Path(ckpt_root) / f"iter_{rollout_id:07d}"


def rank_state_file(coords: dict[str, int]) -> str:
    """One file per rank of a replica, named by its parallel coordinates: ``state_pp0_tp1_cp0_ep1.pt``."""
    return "state_" + "_".join(f"{k}{coords[k]}" for k in ("pp", "tp", "cp", "ep")) + ".pt"


def events_snapshot(ckpt_root: Path, rollout_id: int) -> Path:
    return iter_dir(ckpt_root, rollout_id) / "debug_events"


def latest_checkpoint(ckpt_root: Path) -> int | None:
    """The rollout id of the last complete checkpoint under ``ckpt_root`` (its tracker file), if any."""
    tracker = Path(ckpt_root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def mark_checkpoint_complete(ckpt_root: Path, rollout_id: int) -> None:
    """Write the tracker: only once every rank's file of ``rollout_id`` is in place."""
    (Path(ckpt_root) / TRACKER).write_text(f"{rollout_id}\n")
