"""A cell's health as a debounced tri-state, probed periodically on its own thread.

    Unknown ──check ok──▶ True ──`failure_threshold` failures in a row──▶ False ──check ok──▶ True

One loop turn: (after ``start`` or ``resume`` only) sleep ``first_wait``; if not paused, run
``check_fn`` — it succeeds iff it returns within ``timeout`` without raising — update the
status, and hand the raw result to ``on_result``; then sleep ``interval``. Failures below the
threshold keep the previous status, so one slow RPC does not flap the cell. ``pause``,
``resume`` and ``stop`` all reset the status to Unknown: what was observed before is stale.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ftexp.control.api_models import TriState
from ftexp.control.clock import Clock

log = logging.getLogger(__name__)


class SimpleHealthChecker:
    def __init__(self, check_fn: Callable[[], object], interval: float, timeout: float, first_wait: float,
                 failure_threshold: int, clock: Clock, on_result: Callable[[bool], None] | None = None,
                 name: str = "cell") -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self._check_fn, self._on_result, self._clock, self._name = check_fn, on_result, clock, name
        self._interval, self._timeout, self._first_wait = interval, timeout, first_wait
        self._failure_threshold = failure_threshold
        self._lock = threading.Lock()
        self._status = TriState.UNKNOWN
        self._consecutive_failures = 0
        self._paused = False
        self._need_first_wait = True
        # Bumped by pause/resume/stop so a check that straddles one cannot overwrite the reset.
        self._epoch = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def status(self) -> TriState:
        with self._lock:
            return self._status

    def start(self) -> None:
        """Start the loop; a second call is a no-op (one loop per checker for its whole life)."""
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError(f"health checker {self._name} was stopped; it cannot restart")
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._loop, name=f"health-checker-{self._name}", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopped.set()
            self._reset_to_unknown()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            self._reset_to_unknown()

    def resume(self) -> None:
        """Probe again, after a fresh ``first_wait`` and with the failure count cleared."""
        with self._lock:
            self._paused = False
            self._need_first_wait = True
            self._consecutive_failures = 0
            self._reset_to_unknown()

    def _reset_to_unknown(self) -> None:
        self._status = TriState.UNKNOWN
        self._epoch += 1

    def _loop(self) -> None:
        while not self._stopped.is_set():
            with self._lock:
                first_wait, self._need_first_wait = self._need_first_wait, False
            if first_wait and self._clock.wait(self._stopped, self._first_wait):
                return
            with self._lock:
                paused, epoch = self._paused, self._epoch
            if not paused:
                success = self._run_check()
                self._record(success, epoch)
                self._notify(success)
            if self._clock.wait(self._stopped, self._interval):
                return

    def _run_check(self) -> bool:
        """Run ``check_fn`` on a helper thread and give it ``timeout`` real seconds.

        The timeout bounds a real blocking call (an RPC), so it is measured in real time, not
        on the clock. A check that never returns is abandoned on its daemon thread.
        """
        outcome: list[bool] = []

        def run() -> None:
            try:
                self._check_fn()
                outcome.append(True)
            except Exception as exc:
                log.warning("health check of %s failed: %r", self._name, exc)

        helper = threading.Thread(target=run, name=f"health-check-{self._name}", daemon=True)
        helper.start()
        helper.join(self._timeout)
        if helper.is_alive():
            log.warning("health check of %s timed out after %.1fs", self._name, self._timeout)
        return bool(outcome)

    def _record(self, success: bool, epoch: int) -> None:
        with self._lock:
            if epoch != self._epoch:
                return
            if success:
                self._consecutive_failures = 0
                self._status = TriState.TRUE
            else:
                self._consecutive_failures += 1
                if self._consecutive_failures >= self._failure_threshold:
                    self._status = TriState.FALSE

    def _notify(self, success: bool) -> None:
        if self._on_result is None:
            return
        try:
            self._on_result(success)
        except Exception:
            log.exception("on_result callback of health checker %s raised; ignoring", self._name)
