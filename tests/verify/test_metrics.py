"""compare_metrics over real event logs written with EventLogger."""

import math

import pytest

from ftexp.audit.events import EventLogger, MetricEvent, ProcessIdentity
from ftexp.errors import InputError
from ftexp.verify.metrics import compare_metrics

PREFIXES = ("train/",)


def log_metrics(events_dir, entries, process=0):
    """entries: [(rollout_id, attempt, metrics)]"""
    logger = EventLogger(events_dir, ProcessIdentity(component="dp", rank_within_cell=process))
    for rollout_id, attempt, metrics in entries:
        logger.log(MetricEvent(rollout_id=rollout_id, attempt=attempt, metrics=metrics))
    return events_dir


def run(entries):
    return [(rid, None, {"train/loss": 2.0 - 0.1 * rid, "train/grad_norm": 1.0 + rid, "rollout/reward": 0.5})
            for rid in range(3)] if entries is None else entries


@pytest.fixture
def base(tmp_path):
    return log_metrics(tmp_path / "base", run(None))


def compare(base, target, **kw):
    return compare_metrics(base, target, **{"rtol": 1e-6, "atol": 0.0, "key_prefixes": PREFIXES, **kw})


def test_equal_runs_pass(base, tmp_path):
    target = log_metrics(tmp_path / "target", run(None))
    result = compare(base, target)
    assert result.passed, result.issues
    assert len(result.rows) == 6 and all(r.ok for r in result.rows)
    assert {r.key for r in result.rows} == {"train/loss", "train/grad_norm"}  # prefix filter


def test_rtol_violation_fails_and_within_rtol_passes(base, tmp_path):
    entries = run(None)
    entries[1][2]["train/loss"] *= 1 + 1e-4
    result = compare(base, log_metrics(tmp_path / "far", entries))
    [issue] = result.issues
    assert "rollout 1" in issue and "train/loss" in issue and "rel_diff" in issue
    assert compare(base, log_metrics(tmp_path / "far2", entries), rtol=1e-3).passed
    assert compare(base, log_metrics(tmp_path / "far3", entries), atol=1e-3).passed


def test_other_prefixes_and_excluded_keys(base, tmp_path):
    entries = run(None)
    entries[0][2]["rollout/reward"] = 0.9
    entries[0][2]["train/step_time"] = 123.0
    target = log_metrics(tmp_path / "target", entries)
    assert compare(base, target, exclude_keys=["train/step_time"]).passed
    assert not compare(base, target).passed  # target-only key fails closed
    assert not compare(base, target, key_prefixes=("train/", "rollout/"), exclude_keys=["train/step_time"]).passed


def test_highest_attempt_wins(base, tmp_path):
    entries = run(None)
    discarded = (1, 0, {"train/loss": 99.0, "train/grad_norm": -5.0})
    retried = (1, 1, entries[1][2])
    target = log_metrics(tmp_path / "target", [entries[0], discarded, retried, entries[2]])
    assert compare(base, target).passed
    wrong_final = (1, 1, {**entries[1][2], "train/loss": 99.0})
    target2 = log_metrics(tmp_path / "target2", [entries[0], (1, 0, entries[1][2]), wrong_final, entries[2]])
    assert not compare(base, target2).passed


def test_metrics_of_one_attempt_merge_across_events_and_processes(tmp_path):
    base = log_metrics(tmp_path / "base", [(0, 0, {"train/loss": 1.0, "train/grad_norm": 2.0})])
    target = tmp_path / "target"
    log_metrics(target, [(0, 0, {"train/loss": 1.0})], process=0)
    log_metrics(target, [(0, None, {"train/grad_norm": 2.0})], process=1)
    assert compare(base, target).passed


def test_conflicting_values_within_a_rollout_fail(base, tmp_path):
    target = log_metrics(tmp_path / "target", run(None) + [(2, 0, {"train/loss": 7.0})])
    result = compare(base, target)
    assert any("logged twice" in i and "train/loss" in i for i in result.issues)


def test_missing_key_fails(base, tmp_path):
    entries = run(None)
    del entries[2][2]["train/grad_norm"]
    result = compare(base, log_metrics(tmp_path / "target", entries))
    assert result.issues == ["rollout 2: train/grad_norm missing in target"]


def test_missing_rollout_fails(base, tmp_path):
    result = compare(base, log_metrics(tmp_path / "target", run(None)[:2] + [(7, 0, {"train/loss": 1.0})]))
    assert "rollouts [2] have metrics in baseline but not in target" in result.issues
    assert "rollouts [7] have metrics in target but not in baseline" in result.issues


def test_none_rollout_id_is_its_own_rollout(tmp_path):
    metrics = {"train/loss": 1.0, "train/grad_norm": 1.0}
    base = log_metrics(tmp_path / "base", [(None, None, metrics), (0, 0, metrics)])
    assert compare(base, log_metrics(tmp_path / "t1", [(None, None, metrics), (0, 0, metrics)])).passed
    result = compare(base, log_metrics(tmp_path / "t2", [(0, 0, metrics)]))
    assert result.issues == ["rollouts [None] have metrics in baseline but not in target"]


def write_raw_metric_line(events_dir, loss_json):
    """An event line with a literal JSON token (NaN, Infinity), as a NaN-preserving writer would emit."""
    events_dir.mkdir(parents=True, exist_ok=True)
    line = f'{{"type": "metric", "rollout_id": 0, "metrics": {{"train/loss": {loss_json}, "train/grad_norm": 1.0}}}}'
    (events_dir / "main.jsonl").write_text(line + "\n")
    return events_dir


@pytest.mark.parametrize("b, t, ok", [
    ("NaN", "NaN", False), ("1.0", "NaN", False),
    ("Infinity", "Infinity", True), ("Infinity", "1e308", False), ("-Infinity", "Infinity", False),
    ("0.0", "-0.0", True), ("0", "0.0", True), ("true", "1", True), ("1e-13", "2e-13", False),
    ("null", "null", False), ("1.0", "null", False),
])
def test_special_values(tmp_path, b, t, ok):
    result = compare(write_raw_metric_line(tmp_path / "b", b), write_raw_metric_line(tmp_path / "t", t))
    assert result.passed is ok, result.issues


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_nan_logged_through_event_logger_fails(base, tmp_path, poison):
    # The logger's JSON keeps NaN and inf (as the NaN/Infinity constants); the poisoned value must
    # survive the round trip and be reported, not read as "non-numeric, skipped".
    for side in ("baseline", "target"):
        entries = run(None)
        entries[1][2]["train/loss"] = poison
        other = log_metrics(tmp_path / side, entries)
        pair = (other, base) if side == "baseline" else (base, other)
        result = compare(*pair)
        assert len(result.issues) == 1 and "train/loss" in result.issues[0] and f"={poison}" in result.issues[0]


def test_non_numeric_values_are_listed_not_compared(tmp_path):
    def side(name, v):
        return log_metrics(tmp_path / name, [(0, 0, {"train/loss": 1.0, "train/grad_norm": 1.0, "train/note": v})])

    result = compare(side("b", "a"), side("t", "b"))
    assert result.passed
    [row] = [r for r in result.rows if r.key == "train/note"]
    assert row.ok and row.abs_diff is None and "non-numeric" in row.note


def test_required_key_missing_fails(tmp_path):
    entries = [(0, 0, {"train/loss": 1.0})]
    result = compare(log_metrics(tmp_path / "b", entries), log_metrics(tmp_path / "t", entries))
    assert result.issues == ["required metric train/grad_norm appears in no compared baseline rollout"]
    assert compare(tmp_path / "b", tmp_path / "t", required_keys=["train/loss"]).passed


def test_no_events_fails(base, tmp_path):
    result = compare(base, tmp_path / "absent")
    assert any("target has no metric events" in i for i in result.issues)
    assert not compare(tmp_path / "absent", tmp_path / "absent2").passed


def test_bad_arguments_are_input_errors(base):
    with pytest.raises(InputError, match="required"):
        compare(base, base, key_prefixes=("rollout/",))
    with pytest.raises(InputError, match="required"):
        compare(base, base, exclude_keys=["train/loss"])
    with pytest.raises(InputError, match="key_prefixes"):
        compare(base, base, key_prefixes=())
    with pytest.raises(InputError, match="key_prefixes"):
        compare(base, base, key_prefixes="train/")
    with pytest.raises(InputError, match="rtol"):
        compare(base, base, rtol=math.nan)
    with pytest.raises(InputError, match="atol"):
        compare(base, base, atol=-1)


def test_corrupt_event_log_is_input_error(base, tmp_path):
    target = log_metrics(tmp_path / "target", run(None))
    with open(next(target.glob("*.jsonl")), "a") as f:
        f.write('{"type": "metric", "metrics": \n')
    with pytest.raises(InputError, match="jsonl"):
        compare(base, target)


def test_series_and_to_dict(base, tmp_path):
    entries = run(None)
    entries[2][2]["train/loss"] = 5.0
    result = compare(base, log_metrics(tmp_path / "target", entries))
    assert result.series("baseline")["train/loss"] == [(0, 2.0), (1, 1.9), (2, 1.8)]
    assert result.series("target")["train/loss"][2] == (2, 5.0)
    assert set(result.series("target")) == {"train/loss", "train/grad_norm"}
    data = result.to_dict()
    assert data["passed"] is False and data["rollouts"]["baseline"] == [0, 1, 2]
    assert sum(not r["ok"] for r in data["rows"]) == 1
    check = result.to_check()
    assert check.passed is False and check.details["kind"] == "metrics"
    with pytest.raises(ValueError):
        result.series("other")
