"""Engine weight checks on crafted event logs: a sound log passes, each planted fault is named."""

from ftexp.audit.events import EventLogger, InferenceEngineWeightChecksumEvent, ProcessIdentity, RolloutInjectedEvent
from ftexp.verify.engines import check_engine_updates, check_injections, compare_inference_engine_checksums

W0 = {"model.norm.weight": "a0", "lm_head.weight": "b0"}
W1 = {"model.norm.weight": "a1", "lm_head.weight": "b1"}


def write(events_dir, *updates):
    logger = EventLogger(events_dir, ProcessIdentity(component="main"))
    for rollout_id, engines in updates:
        logger.log(InferenceEngineWeightChecksumEvent(rollout_id=rollout_id, engine_checksums=engines))
    return events_dir


def test_every_rollout_updated_consistently_passes(tmp_path):
    events = write(tmp_path, (None, [W0, W0]), (0, [W1, W1]), (1, [W0, W0]))
    check = check_engine_updates(events, [0, 1], num_engines=2, name="engines")
    assert check.passed, check.summary


def test_a_skipped_update_and_a_stale_engine_are_named(tmp_path):
    events = write(tmp_path, (None, [W0, W0]), (0, [W1, W0]))
    check = check_engine_updates(events, [0, 1], num_engines=2, name="engines")
    assert not check.passed
    assert any("engine_1 differs" in i for i in check.details["issues"])
    assert any("no engine update after rollouts [1]" in i for i in check.details["issues"])


def test_a_missing_engine_fails(tmp_path):
    events = write(tmp_path, (None, [W0]), (0, [W1]))
    assert not check_engine_updates(events, [0], num_engines=2, name="engines").passed


def test_sides_with_equal_engine_weights_pass_whatever_their_engine_counts(tmp_path):
    base = write(tmp_path / "b", (None, [W0]), (0, [W1]), (1, [W0]))
    targ = write(tmp_path / "t", (None, [W0, W0]), (0, [W1, W1]), (1, [W0, W0]))
    check = compare_inference_engine_checksums(base, targ, "engines_vs_baseline")
    assert check.passed and check.details["rollouts"] == [0, 1], check.summary


def test_sides_that_pushed_different_weights_fail_naming_the_rollout_and_tensor(tmp_path):
    base = write(tmp_path / "b", (0, [W0]), (1, [W0]))
    targ = write(tmp_path / "t", (0, [W0]), (1, [{**W0, "lm_head.weight": "other"}]))
    check = compare_inference_engine_checksums(base, targ, "engines_vs_baseline")
    assert not check.passed and "rollout 1" in check.summary and "lm_head.weight" in check.summary


def test_no_events_on_a_side_fails_closed(tmp_path):
    base = write(tmp_path / "b", (0, [W0]))
    (tmp_path / "t").mkdir()
    check = compare_inference_engine_checksums(base, tmp_path / "t", "engines_vs_baseline")
    assert not check.passed and "target: no engine checksum events" in check.details["issues"]


def inject(events_dir, *ratios):
    logger = EventLogger(events_dir, ProcessIdentity(component="main"))
    for rollout_id, ratio in ratios:
        logger.log(RolloutInjectedEvent(rollout_id=rollout_id, num_samples=8, match_ratio=ratio, min_match_ratio=0.5))
    return events_dir


def test_planned_injections_above_the_ratio_pass_and_report_it(tmp_path):
    check = check_injections(inject(tmp_path, (3, 0.71)), [3], 0.5, "injections")
    assert check.passed and check.details["match_ratios"] == {3: 0.71}


def test_a_missing_or_unplanned_or_low_injection_fails(tmp_path):
    assert not check_injections(inject(tmp_path / "a"), [3], 0.5, "injections").passed
    assert not check_injections(inject(tmp_path / "b", (2, 0.9), (3, 0.9)), [3], 0.5, "injections").passed
    assert not check_injections(inject(tmp_path / "c", (3, 0.5)), [3], 0.5, "injections").passed  # strictly above
