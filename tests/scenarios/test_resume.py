"""The absolute resume checks, on synthetic event logs: each side of a resumed phase against the plan alone."""

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from ftexp.audit.events import (EventLogger, MetricEvent, ProcessIdentity, TrainResumeEvent, WitnessAllocateIdEvent,
                                WitnessSnapshotParamEvent)
from ftexp.cli import CONFIG_MODULE, register_configs, to_config
from ftexp.rundir import BASELINE, events_snapshot, side_dir
from ftexp.scenarios.resume import check_resume, resume_checkpoint, saved_rollouts

SAMPLES = 256  # the stock rollout: 32 prompts x 8 samples


@pytest.fixture(scope="module")
def cfg():
    register_configs()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return to_config(compose(config_name="config", overrides=["scenario=with_failure", "mode=dp2"]))


def _rollout(log: EventLogger, rollout_id: int, counter_after: int) -> None:
    """What baseline rank 0 logs for one rollout: the allocation, the witness snapshot, the metrics."""
    ids = list(range(counter_after - SAMPLES, counter_after))
    log.log(WitnessAllocateIdEvent(rollout_id=rollout_id, attempt=0, witness_id_to_sample_index={i: n for n, i in enumerate(ids)},
                                   counter_after=counter_after))
    log.log(WitnessSnapshotParamEvent(rollout_id=rollout_id, attempt=0, instance_id="head", nonzero_witness_id_ranges=[(ids[0], ids[-1] + 1)],
                                      stale_id_ranges=[]))
    log.log(MetricEvent(rollout_id=rollout_id, attempt=0, metrics={"train/loss": 0.0}))


def _baseline_run(run_dir: Path, *, restore: bool = True, counter: int | None = None, first: int = 1,
                  loaded: list[int] = (0, 0)) -> None:
    """phase_a trains rollout 0 and checkpoints it; phase_b resumes (restoring its log unless told not to)."""
    phase_a, phase_b = side_dir(run_dir, BASELINE, "phase_a"), side_dir(run_dir, BASELINE, "phase_b")
    _rollout(EventLogger(phase_a.events, ProcessIdentity(component="dp", rank_within_cell=0)), 0, SAMPLES)
    shutil.copytree(phase_a.events, events_snapshot(phase_a.ckpt, 0))
    if restore:
        shutil.copytree(phase_a.events, phase_b.events)
    log = EventLogger(phase_b.events, ProcessIdentity(component="dp", rank_within_cell=0))
    resumed = SAMPLES if counter is None else counter
    log.log(TrainResumeEvent(checkpoint_rollout_id=first - 1, loaded_rollout_ids=list(loaded), first_rollout_id=first,
                             witness_counter=resumed))
    for n, rollout_id in enumerate(range(first, 6), 1):
        _rollout(log, rollout_id, resumed + n * SAMPLES)


def _check(cfg, run_dir: Path):
    phase_b = cfg.scenario.phases[1]
    return check_resume(cfg, run_dir, phase_b, BASELINE, [1, 2, 3, 4, 5], "phase_b/baseline_resume")


def test_the_checkpoint_is_derived_from_the_plan(cfg):
    phase_a, phase_b = cfg.scenario.phases
    assert saved_rollouts(cfg, phase_a) == [0] and resume_checkpoint(cfg, phase_b) == 0


def test_a_restored_resume_passes(cfg, tmp_path):
    _baseline_run(tmp_path)
    check = _check(cfg, tmp_path)
    assert check.passed, check.details["issues"]
    assert check.summary.startswith("resumed from checkpoint 0 (2 rank states), witness counter 256")


def test_a_log_not_restored_fails_though_every_number_after_it_is_self_consistent(cfg, tmp_path):
    _baseline_run(tmp_path, restore=False, counter=0)  # the counter restarted, phase_a's history is gone
    check = _check(cfg, tmp_path)
    assert not check.passed
    issues = "\n".join(check.details["issues"])
    assert "restored log lacks the commit events of rollouts [0]" in issues
    assert "witness counter resumed at 0, the checkpoint's snapshot holds 256" in issues
    assert "event snapshot dp_rank0.jsonl does not start with the snapshot's events" in issues


@pytest.mark.parametrize("kwargs, message", [
    ({"counter": 200}, "witness counter resumed at 200, the checkpoint's snapshot holds 256"),
    ({"loaded": [0, -1]}, "loaded rank states last committed [0, -1], expected 2 x 0"),
])
def test_what_was_restored_must_be_the_checkpoints(cfg, tmp_path, kwargs, message):
    _baseline_run(tmp_path, **kwargs)
    check = _check(cfg, tmp_path)
    assert not check.passed and message in "\n".join(check.details["issues"])


def test_a_resume_from_the_wrong_rollout_or_without_its_event_fails(cfg, tmp_path):
    _baseline_run(tmp_path / "late", first=2, loaded=[1, 1])
    issues = "\n".join(_check(cfg, tmp_path / "late").details["issues"])
    assert "resumed from checkpoint 1, the plan's is 0" in issues and "expected to start at 1" in issues
    _baseline_run(tmp_path / "silent")
    path = side_dir(tmp_path / "silent", BASELINE, "phase_b").events / "dp_rank0.jsonl"
    path.write_text("".join(ln + "\n" for ln in path.read_text().splitlines() if '"train_resume"' not in ln))
    check = _check(cfg, tmp_path / "silent")
    assert not check.passed and "0 train_resume events" in check.summary
