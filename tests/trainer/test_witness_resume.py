"""The witness counter after a checkpoint resume continues from the checkpoint's event snapshot."""

from pathlib import Path

from ftexp.audit.events import EventLogger, ProcessIdentity
from ftexp.audit.witness import WitnessIdAllocator, allocation_event
from ftexp.config import TrainerConfig
from ftexp.trainer.side import SideSpec, snapshot_events, start_event_log


def spec(side_dir: Path, load_dir: Path | None = None) -> SideSpec:
    return SideSpec(side="target", phase="", side_dir=side_dir, data_dir=side_dir / "data", trainer=TrainerConfig(),
                    num_cells=2, num_rollout=8, load_dir=load_dir)


def allocate(events_dir: Path, allocator: WitnessIdAllocator, rollout_id: int, attempts: int = 1) -> None:
    logger = EventLogger(events_dir, ProcessIdentity(component="main"))
    for attempt in range(attempts):
        logger.log(allocation_event(rollout_id, attempt, allocator.allocate(256), allocator.counter))


def checkpoint(side_dir: Path, rollout_id: int) -> None:
    """What ``save`` leaves behind: the tracker and the event-dir snapshot."""
    ckpt = side_dir / "ckpt"
    snapshot_events(side_dir / "events", ckpt / f"iter_{rollout_id:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{rollout_id}\n")


def test_cold_start_counts_from_zero_or_from_its_own_log(tmp_path):
    phase = spec(tmp_path / "a")
    assert start_event_log(phase) == 0
    allocate(phase.events_dir, WitnessIdAllocator(1 << 20), 0, attempts=2)
    assert start_event_log(phase) == 512


def test_resume_continues_from_the_checkpoint_snapshot_not_from_later_events(tmp_path):
    allocator = WitnessIdAllocator(1 << 20)
    phase_a = spec(tmp_path / "a")
    allocate(phase_a.events_dir, allocator, 0)
    allocate(phase_a.events_dir, allocator, 1, attempts=2)  # a retry: 768 ids so far
    checkpoint(phase_a.side_dir, 1)
    allocate(phase_a.events_dir, allocator, 2)  # after the checkpoint: never in its weights
    assert allocator.counter == 1024

    phase_b = spec(tmp_path / "b", load_dir=phase_a.ckpt_dir)
    allocate(phase_b.events_dir, WitnessIdAllocator(1 << 20), 5, attempts=8)  # a previous, abandoned run of phase_b
    counter = start_event_log(phase_b)
    assert counter == 768
    resumed = WitnessIdAllocator(1 << 20)
    resumed.resume(counter)
    assert resumed.allocate(2).witness_ids == [768, 769]
    # The restored log is the snapshot: the abandoned run's events are gone.
    assert not (phase_b.events_dir / "main.jsonl").read_text().count('"rollout_id":5')
