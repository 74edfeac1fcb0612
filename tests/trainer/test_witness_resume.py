"""The witness counter after a checkpoint resume continues from the checkpoint's event snapshot."""

from pathlib import Path

from ftexp.audit.events import EventLogger, ProcessIdentity
from ftexp.audit.witness import WitnessIdAllocator, allocation_event
from ftexp.config import ModeConfig, TrainerConfig
from ftexp.faults.plan import FaultPlan
from ftexp.job import JobSpec
from ftexp.rundir import SideDir
from ftexp.trainer.checkpoint import complete_checkpoint, start_event_log


def spec(root: Path, load_dir: Path | None = None) -> JobSpec:
    return JobSpec(side="target", phase="", side_dir=SideDir(root), data_dir=root / "data", trainer=TrainerConfig(),
                   mode=ModeConfig(name="dp2", num_cells=2), num_rollout=8, plan=FaultPlan([], 2), load_dir=load_dir)


def allocate(events_dir: Path, allocator: WitnessIdAllocator, rollout_id: int, attempts: int = 1) -> None:
    logger = EventLogger(events_dir, ProcessIdentity(component="main"))
    for attempt in range(attempts):
        logger.log(allocation_event(rollout_id, attempt, allocator.allocate(256), allocator.counter))


def checkpoint(side_dir: SideDir, rollout_id: int) -> None:
    """What ``save`` leaves behind: the tracker and the event-dir snapshot."""
    complete_checkpoint(side_dir.ckpt, rollout_id, side_dir.events)


def test_cold_start_counts_from_zero_or_from_its_own_log(tmp_path):
    phase = spec(tmp_path / "a")
    assert start_event_log(phase) == 0
    allocate(phase.side_dir.events, WitnessIdAllocator(1 << 20), 0, attempts=2)
    assert start_event_log(phase) == 512


def test_resume_continues_from_the_checkpoint_snapshot_not_from_later_events(tmp_path):
    allocator = WitnessIdAllocator(1 << 20)
    phase_a = spec(tmp_path / "a")
    allocate(phase_a.side_dir.events, allocator, 0)
    allocate(phase_a.side_dir.events, allocator, 1, attempts=2)  # a retry: 768 ids so far
    checkpoint(phase_a.side_dir, 1)
    allocate(phase_a.side_dir.events, allocator, 2)  # after the checkpoint: never in its weights
    assert allocator.counter == 1024

    phase_b = spec(tmp_path / "b", load_dir=phase_a.side_dir.ckpt)
    allocate(phase_b.side_dir.events, WitnessIdAllocator(1 << 20), 5, attempts=8)  # a previous, abandoned run of phase_b
    counter = start_event_log(phase_b)
    assert counter == 768
    resumed = WitnessIdAllocator(1 << 20)
    resumed.resume(counter)
    assert resumed.allocate(2).witness_ids == [768, 769]
    # The restored log is the snapshot: the abandoned run's events are gone.
    assert not (phase_b.side_dir.events / "main.jsonl").read_text().count('"rollout_id":5')
