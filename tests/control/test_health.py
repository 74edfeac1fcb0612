"""SimpleHealthChecker stepped on a FakeClock: first wait, debounce, tri-state, pause/resume."""

import threading

import pytest

from ftexp.control.api_models import TriState
from ftexp.control.clock import FakeClock
from ftexp.control.health import SimpleHealthChecker

INTERVAL, FIRST_WAIT, THRESHOLD = 10.0, 300.0, 3


class ScriptedCheck:
    """A check function whose outcomes the test queues; it succeeds when nothing is queued."""

    def __init__(self):
        self.outcomes: list[bool] = []
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.outcomes and not self.outcomes.pop(0):
            raise ConnectionError("heartbeat RPC failed")


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def check():
    return ScriptedCheck()


@pytest.fixture
def make_checker(clock, check):
    made = []

    def make(**kwargs):
        args = dict(check_fn=check, interval=INTERVAL, timeout=1.0, first_wait=FIRST_WAIT,
                    failure_threshold=THRESHOLD, clock=clock)
        checker = SimpleHealthChecker(**(args | kwargs))
        made.append(checker)
        return checker

    yield make
    for checker in made:
        checker.stop()


def tick(clock, seconds):
    """Advance time and wait until the checker thread has finished its turn and parked again."""
    clock.advance(seconds)
    clock.wait_for_sleepers(1)


def started(make_checker, clock, **kwargs):
    """A started checker past its first wait, having run exactly one check."""
    checker = make_checker(**kwargs)
    checker.start()
    clock.wait_for_sleepers(1)
    tick(clock, FIRST_WAIT)
    return checker


def test_no_check_before_the_first_wait(make_checker, clock, check):
    checker = make_checker()
    assert checker.status is TriState.UNKNOWN
    checker.start()
    clock.wait_for_sleepers(1)
    tick(clock, FIRST_WAIT - 1)
    assert check.calls == 0
    assert checker.status is TriState.UNKNOWN
    tick(clock, 1)
    assert check.calls == 1
    assert checker.status is TriState.TRUE
    tick(clock, INTERVAL)
    assert check.calls == 2


def test_start_is_idempotent(make_checker, clock, check):
    checker = make_checker()
    checker.start()
    checker.start()
    assert [t.name for t in threading.enumerate()].count("health-checker-cell") == 1
    clock.wait_for_sleepers(1)
    tick(clock, FIRST_WAIT)
    assert check.calls == 1


def test_debounce_keeps_previous_status_below_threshold(make_checker, clock, check):
    checker = started(make_checker, clock)
    assert checker.status is TriState.TRUE
    check.outcomes = [False, False, False]
    tick(clock, INTERVAL)
    tick(clock, INTERVAL)
    assert checker.status is TriState.TRUE  # 2 < threshold
    tick(clock, INTERVAL)
    assert checker.status is TriState.FALSE
    tick(clock, INTERVAL)  # one success recovers at once
    assert checker.status is TriState.TRUE


def test_failures_from_unknown_stay_unknown_until_threshold(make_checker, clock, check):
    check.outcomes = [False, False, False]
    checker = started(make_checker, clock)
    tick(clock, INTERVAL)
    assert check.calls == 2
    assert checker.status is TriState.UNKNOWN
    tick(clock, INTERVAL)
    assert checker.status is TriState.FALSE


def test_success_resets_the_failure_count(make_checker, clock, check):
    checker = started(make_checker, clock)
    check.outcomes = [False, False, True, False, False]
    for _ in range(5):
        tick(clock, INTERVAL)
    assert checker.status is TriState.TRUE


def test_on_result_gets_raw_results(make_checker, clock, check):
    results = []
    check.outcomes = [True, False, True]
    started(make_checker, clock, on_result=results.append)
    tick(clock, INTERVAL)
    tick(clock, INTERVAL)
    assert results == [True, False, True]  # the False is reported although the status stays True


def test_on_result_exception_does_not_kill_the_loop(make_checker, clock, check):
    def explode(success):
        raise RuntimeError("callback bug")

    checker = started(make_checker, clock, on_result=explode)
    tick(clock, INTERVAL)
    tick(clock, INTERVAL)
    assert check.calls == 3
    assert checker.status is TriState.TRUE


def test_timeout_counts_as_failure(make_checker, clock):
    release = threading.Event()
    checker = started(make_checker, clock, check_fn=lambda: release.wait(), timeout=0.05, failure_threshold=1)
    release.set()
    assert checker.status is TriState.FALSE


def test_pause_stops_checks_and_reports_unknown(make_checker, clock, check):
    checker = started(make_checker, clock)
    checker.pause()
    assert checker.status is TriState.UNKNOWN
    for _ in range(3):
        tick(clock, INTERVAL)
    assert check.calls == 1
    assert checker.status is TriState.UNKNOWN


def test_resume_reapplies_first_wait(make_checker, clock, check):
    checker = started(make_checker, clock)
    checker.pause()
    tick(clock, INTERVAL)
    checker.resume()
    tick(clock, INTERVAL)  # ends the interval sleep; the first wait starts now
    tick(clock, FIRST_WAIT - 1)
    assert check.calls == 1
    assert checker.status is TriState.UNKNOWN
    tick(clock, 1)
    assert check.calls == 2
    assert checker.status is TriState.TRUE


def test_resume_resets_failures(make_checker, clock, check):
    checker = started(make_checker, clock)
    check.outcomes = [False, False, False]
    tick(clock, INTERVAL)
    tick(clock, INTERVAL)
    checker.pause()
    checker.resume()
    tick(clock, INTERVAL)
    tick(clock, FIRST_WAIT)  # third failure, but the count restarted at 0
    assert check.calls == 4
    assert checker.status is TriState.UNKNOWN


def test_a_check_straddling_pause_does_not_overwrite_unknown(make_checker, clock):
    entered, release = threading.Event(), threading.Event()

    def slow_check():
        entered.set()
        release.wait()

    checker = make_checker(check_fn=slow_check, timeout=5.0)
    checker.start()
    clock.wait_for_sleepers(1)
    clock.advance(FIRST_WAIT)
    assert entered.wait(1.0)
    checker.pause()
    release.set()
    clock.wait_for_sleepers(1)
    assert checker.status is TriState.UNKNOWN


def test_stop_reports_unknown_and_ends_the_thread(make_checker, clock):
    checker = started(make_checker, clock)
    assert checker.status is TriState.TRUE
    checker.stop()
    assert checker.status is TriState.UNKNOWN
    assert "health-checker-cell" not in [t.name for t in threading.enumerate()]
    with pytest.raises(RuntimeError, match="stopped"):
        checker.start()


def test_threshold_must_be_positive(clock, check):
    with pytest.raises(ValueError, match="failure_threshold"):
        SimpleHealthChecker(check, INTERVAL, 1.0, FIRST_WAIT, 0, clock)
