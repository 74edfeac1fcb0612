"""Time as a dependency: every loop in the control plane reads and sleeps through a ``Clock``.

``RealClock`` is the process's monotonic clock. ``FakeClock`` only moves when a test calls ``advance``;
threads sleeping on it wake once their deadline is reached, so periodic loops (health checks,
controller polls, injector polls) can be stepped deterministically:

    clock.wait_for_sleepers(1)   # the loop thread is parked in a sleep
    clock.advance(10.0)          # wakes it; it runs one turn ...
    clock.wait_for_sleepers(1)   # ... and is parked again
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences are meaningful)."""

    def sleep(self, seconds: float) -> None:
        """Block for ``seconds``."""

    def wait(self, event: threading.Event, seconds: float) -> bool:
        """Block until ``event`` is set or ``seconds`` pass; return whether the event is set."""


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return event.wait(max(0.0, seconds))


# A set Event cannot notify our condition, so a sleeper that can be interrupted re-checks it this often.
_EVENT_POLL_S = 0.005


class FakeClock:
    """Manually advanced time for tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._cond = threading.Condition()
        self._deadlines: dict[object, float] = {}  # one entry per parked sleeper

    def now(self) -> float:
        with self._cond:
            return self._now

    def sleep(self, seconds: float) -> None:
        self._park(seconds, None)

    def wait(self, event: threading.Event, seconds: float) -> bool:
        return self._park(seconds, event)

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline is reached.

        Woken sleepers are unregistered here, before this returns, so a following
        ``wait_for_sleepers`` waits for them to park *again*.
        """
        with self._cond:
            self._now += seconds
            for token, deadline in list(self._deadlines.items()):
                if deadline <= self._now:
                    del self._deadlines[token]
            self._cond.notify_all()

    @property
    def sleepers(self) -> int:
        with self._cond:
            return len(self._deadlines)

    def wait_for_sleepers(self, count: int = 1, timeout: float = 5.0) -> None:
        """Block (in real time) until at least ``count`` threads are parked on this clock."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._deadlines) >= count, timeout):
                raise TimeoutError(f"{len(self._deadlines)} sleepers after {timeout}s, expected {count}")

    def _park(self, seconds: float, event: threading.Event | None) -> bool:
        with self._cond:
            if event is not None and event.is_set():
                return True
            if seconds <= 0:
                return False
            token = object()
            self._deadlines[token] = self._now + seconds
            self._cond.notify_all()  # a test may be blocked in wait_for_sleepers
            while token in self._deadlines:
                if event is not None and event.is_set():
                    del self._deadlines[token]
                    self._cond.notify_all()
                    return True
                self._cond.wait(None if event is None else _EVENT_POLL_S)
            return event is not None and event.is_set()
