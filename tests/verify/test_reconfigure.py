"""Reconfigure assertions over CellReconfigureEvents written with EventLogger."""

import pytest

from ftexp.audit.events import CellReconfigureEvent, EventLogger, MetricEvent, ProcessIdentity
from ftexp.errors import InputError
from ftexp.verify.reconfigure import ReconfigureInfo, check_reconfigure_events, reconfigure_infos

SHRINK = ReconfigureInfo(rollout_id=2, src_cell_index=None, healed_cell_indices=[], alive_cell_indices_after=[0])
HEAL = ReconfigureInfo(rollout_id=3, src_cell_index=0, healed_cell_indices=[1], alive_cell_indices_after=[0, 1])


@pytest.fixture
def events_dir(tmp_path):
    logger = EventLogger(tmp_path / "events", ProcessIdentity(component="main"))
    logger.log(MetricEvent(rollout_id=2, metrics={"train/loss": 1.0}))  # other events are ignored
    logger.log(CellReconfigureEvent(rollout_id=2, quorum_id=7, src_cell_index=None, healed_cell_indices=[],
                                    alive_cell_indices_after=[0]))
    logger.log(CellReconfigureEvent(rollout_id=3, quorum_id=8, src_cell_index=0, healed_cell_indices=[1],
                                    alive_cell_indices_after=[0, 1], timings={"send": 0.5}, bytes_transferred=10))
    return tmp_path / "events"


def test_infos_in_read_order_without_quorum(events_dir):
    infos = reconfigure_infos(events_dir)
    assert infos == [SHRINK, HEAL]
    assert infos[1].healed_cell_indices == (1,)  # lists and tuples compare by content
    assert not hasattr(infos[0], "quorum_id")


def test_exact_match_passes(events_dir):
    result = check_reconfigure_events(events_dir, [SHRINK, HEAL])
    assert result.passed and result.name == "reconfigure_events"
    assert result.details["kind"] == "reconfigure" and len(result.details["actual"]) == 2


@pytest.mark.parametrize("expected", [
    [HEAL, SHRINK],
    [SHRINK],
    [SHRINK, HEAL, HEAL],
    [],
    [SHRINK, ReconfigureInfo(3, 0, [1], [1, 0])],
    [SHRINK, ReconfigureInfo(3, None, [1], [0, 1])],
])
def test_any_difference_fails_and_shows_both(events_dir, expected):
    result = check_reconfigure_events(events_dir, expected)
    assert not result.passed
    assert "expected" in result.summary and "actual" in result.summary and "rollout_id=3" in result.summary


def test_missing_dir_fails_even_when_nothing_is_expected(tmp_path):
    result = check_reconfigure_events(tmp_path / "nope", [])
    assert not result.passed and "does not exist" in result.summary


def test_existing_dir_without_events_matches_empty_expectation(tmp_path):
    (tmp_path / "events").mkdir()
    assert check_reconfigure_events(tmp_path / "events", []).passed
    assert not check_reconfigure_events(tmp_path / "events", [HEAL]).passed


def test_corrupt_log_is_input_error(events_dir):
    (events_dir / "main.jsonl").write_text("{broken\n")
    with pytest.raises(InputError):
        reconfigure_infos(events_dir)
