"""FakeClock: sleepers wake exactly when advanced time reaches their deadline; waits are interruptible."""

import threading

import pytest

from ftexp.control.clock import FakeClock, RealClock


def park(target):
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_sleeper_wakes_only_at_its_deadline():
    clock = FakeClock(start=100.0)
    thread = park(lambda: clock.sleep(10.0))
    clock.wait_for_sleepers(1)
    clock.advance(9.0)
    thread.join(0.05)
    assert thread.is_alive() and clock.sleepers == 1
    clock.advance(1.0)
    assert clock.sleepers == 0  # unregistered by advance itself, before it returns
    thread.join(1.0)
    assert not thread.is_alive()
    assert clock.now() == 110.0


def test_wait_returns_true_when_the_event_is_set_and_false_at_the_deadline():
    clock, event, results = FakeClock(), threading.Event(), []
    thread = park(lambda: results.append(clock.wait(event, 5.0)))
    clock.wait_for_sleepers(1)
    clock.advance(5.0)
    thread.join(1.0)
    thread = park(lambda: results.append(clock.wait(event, 5.0)))
    clock.wait_for_sleepers(1)
    event.set()
    thread.join(1.0)
    assert results == [False, True]
    assert clock.sleepers == 0
    assert clock.now() == 5.0


def test_wait_for_sleepers_times_out():
    with pytest.raises(TimeoutError):
        FakeClock().wait_for_sleepers(1, timeout=0.05)


def test_real_clock_wait_is_interruptible():
    event = threading.Event()
    event.set()
    clock = RealClock()
    start = clock.now()
    assert clock.wait(event, 10.0) is True
    assert clock.now() - start < 1.0
