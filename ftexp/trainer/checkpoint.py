"""Checkpoints, written the same way by both sides: one file per rank, then the tracker and the event log.

Every rank of the writing replica saves its own state (``state_<coords>.pt``, so a replica split
over TP/PP/CP/EP ranks resumes rank by rank). Once all of them are in place, one rank marks the
checkpoint complete and snapshots the event log into it, so the audit trail — and the witness
counter it holds — survives a resume.
"""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path
from typing import Any

import torch

from ftexp.atomic_files import torch_save_atomically
from ftexp.audit.events import TrainResumeEvent, read_events
from ftexp.audit.witness import persisted_counter
from ftexp.errors import RunDirError, file_error
from ftexp.faults.plan import NegativeControl
from ftexp.job import JobSpec
from ftexp.rundir import (TRACKER, events_snapshot, iter_dir, latest_checkpoint, mark_checkpoint_complete,
                          rank_state_file)


def save_rank_state(replica, ckpt_root: Path, rollout_id: int) -> None:
    """This rank's ``<ckpt_root>/iter_<id:07d>/state_<coords>.pt``, written atomically."""
    torch_save_atomically(replica.state_dict(), iter_dir(ckpt_root, rollout_id) / rank_state_file(replica.coords))


def complete_checkpoint(ckpt_root: Path, rollout_id: int, events_dir: Path) -> None:
    """After every rank's file is written: snapshot the event log, then mark the checkpoint complete
    (last, so a checkpoint the tracker names always has its events)."""
    dst = events_snapshot(ckpt_root, rollout_id)
    if dst.exists():
        shutil.rmtree(dst)
    if events_dir.is_dir():
        shutil.copytree(events_dir, dst)
    mark_checkpoint_complete(ckpt_root, rollout_id)


def load_rank_state(ckpt_root: Path, rollout_id: int, coords: dict[str, int]) -> dict[str, Any]:
    """This rank's state; RunDirError (one line naming the file) if it is missing, unreadable or corrupt."""
    path = iter_dir(ckpt_root, rollout_id) / rank_state_file(coords)
    if not path.is_file():
        raise RunDirError(f"no checkpoint {path} (was it written by another parallel layout?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for a truncated or foreign file
        raise file_error(path, e, "checkpoint file") from e


def check_resumable(ckpt_root: Path) -> int:
    """The rollout id a phase resumes from, checked before any job starts: the tracker names a
    checkpoint whose rank files are all torch archives. RunDirError says what is missing or corrupt."""
    tracker = Path(ckpt_root) / TRACKER
    try:
        text = tracker.read_text().strip()
    except OSError as e:
        raise file_error(tracker, e, "checkpoint tracker") from e
    if not text.isdigit():
        raise RunDirError(f"corrupt checkpoint tracker {tracker}: {text[:40]!r} is not a rollout id")
    directory = iter_dir(ckpt_root, int(text))
    files = sorted(directory.glob("state_*.pt"))
    if not files:
        raise RunDirError(f"missing checkpoint {directory}: {tracker} names it but it holds no state_*.pt file")
    for path in files:
        try:
            ok = zipfile.is_zipfile(path)  # torch.save writes a zip archive; garbage or a cut file is not one
        except OSError as e:
            raise file_error(path, e, "checkpoint file") from e
        if not ok:
            raise RunDirError(f"corrupt checkpoint file {path}: not a torch archive (truncated or overwritten?)")
    return int(text)


def restore_events(load_dir: Path, events_dir: Path) -> None:
    """Start this run's event dir from the loaded checkpoint's snapshot, if it has one."""
    loaded = latest_checkpoint(load_dir)
    snap = events_snapshot(load_dir, loaded) if loaded is not None else None
    if snap is not None and snap.is_dir():
        if events_dir.exists():
            shutil.rmtree(events_dir)
        shutil.copytree(snap, events_dir)


def start_event_log(spec: JobSpec) -> int:
    """Set up the side's event dir; return the witness counter to continue from.

    On resume the dir is first replaced by the loaded checkpoint's snapshot, and only then is the
    counter read: allocations logged after that checkpoint never reached its weights, so their ids
    are free again, while every id the checkpoint's weights hold stays taken.
    """
    if spec.load_dir is not None and spec.trainer.negative_control != NegativeControl.skip_event_restore:
        restore_events(spec.load_dir, spec.side_dir.events)
    return persisted_counter(read_events(spec.side_dir.events))


def resume_event(spec: JobSpec, witness_counter: int, loaded_rollout_ids: list[int]) -> TrainResumeEvent:
    """What a resumed job restored: the checkpoint, what its loaded rank states say they last
    committed, the first rollout it trains and the witness counter it continues from."""
    return TrainResumeEvent(checkpoint_rollout_id=spec.start_rollout_id() - 1, loaded_rollout_ids=sorted(loaded_rollout_ids),
                            first_rollout_id=spec.rollout_ids().start, witness_counter=witness_counter)
