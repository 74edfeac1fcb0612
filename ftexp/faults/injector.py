"""The external random fault injector for soak tests.

A daemon thread polls the control server every ``poll_interval`` seconds and, at exponentially
distributed times (mean ``time_unit_s / max(crash_probability, 0.01)``), POSTs a random failure
mode into a random cell — but never into the last genuinely alive one, because healing needs a
live source cell. A cell is alive when it reads ``Healthy=True`` and is not ``Initialized=False``:
a restarted cell that awaits its heal answers health checks but has no state to heal anyone from.

"Genuinely" is the ``RecoveryGate``'s job. A just-killed cell keeps reading ``Healthy=True`` for
a long while (no RPC has failed yet, and the heartbeat checker is in its grace period), so the
raw view over-counts live cells. The gate remembers every cell we injected and keeps treating it
as not alive until it has been seen down (missing, or not Healthy=True) and then up again.

    note_injected ──▶ INJECTED ──seen down──▶ RECOVERING ──seen up──▶ forgotten (genuinely alive)
                      (still reads alive: stale view, stays INJECTED)
"""

from __future__ import annotations

import datetime as _dt
import enum
import logging
import random
import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import httpx

from ftexp.control.api_models import Cell, CellList, TriState
from ftexp.control.clock import Clock, RealClock
from ftexp.errors import InputError
from ftexp.http_client import short_keepalive_client
from ftexp.control.failure_modes import FailureMode

log = logging.getLogger(__name__)
HTTP_TIMEOUT_S = 5.0
# A deadlocked cell is only noticed after the heartbeat grace period; soak tests want crashes.
DEFAULT_MODES = (FailureMode.SIGKILL, FailureMode.EXIT, FailureMode.SEGFAULT)


def is_alive(cell: Cell) -> bool:
    """Healthy, and holds model state (a server that does not report ``Initialized`` is taken at its word)."""
    conditions = {c.type: c.status for c in cell.status.conditions}
    return conditions.get("Healthy") == TriState.TRUE and conditions.get("Initialized") != TriState.FALSE


class GateState(enum.Enum):
    INJECTED = "injected"
    RECOVERING = "recovering"


class RecoveryGate:
    def __init__(self) -> None:
        self._tracked: dict[str, GateState] = {}

    def state(self, name: str) -> GateState | None:
        """None when the cell is not tracked (never injected, or fully recovered)."""
        return self._tracked.get(name)

    def note_injected(self, name: str) -> None:
        self._tracked[name] = GateState.INJECTED

    def observe(self, cells_by_name: Mapping[str, Cell]) -> None:
        for name, state in list(self._tracked.items()):
            cell = cells_by_name.get(name)
            if cell is None or not is_alive(cell):
                self._tracked[name] = GateState.RECOVERING
            elif state is GateState.RECOVERING:
                del self._tracked[name]

    def genuinely_alive(self, cells: Iterable[Cell]) -> list[Cell]:
        return [c for c in cells if is_alive(c) and c.metadata.name not in self._tracked]


@dataclass(frozen=True)
class Injection:
    timestamp: _dt.datetime  # UTC wall time, comparable with the event log
    cell: str
    mode: FailureMode


class RandomInjector:
    def __init__(self, base_url: str, seed: int, crash_probability: float, time_unit_s: float = 60.0,
                 poll_interval: float = 2.0, modes: Sequence[FailureMode] = DEFAULT_MODES,
                 clock: Clock | None = None, http_client: httpx.Client | None = None,
                 first_mode: FailureMode | None = None, first_after_s: float | None = None) -> None:
        if not 0.0 <= crash_probability <= 1.0:
            raise InputError(f"crash_probability must be in [0, 1], got {crash_probability}")
        if not modes:
            raise InputError("the injector needs at least one failure mode")
        self._cells_url = f"{base_url.rstrip('/')}/api/v1/cells"
        self.mean_interval_s = time_unit_s / max(crash_probability, 0.01)
        self._poll_interval, self._modes = poll_interval, [FailureMode(m) for m in modes]
        # A soak can force its first injection's mode (e.g. a deadlock) so that every seed covers it.
        self._first_mode = FailureMode(first_mode) if first_mode is not None else None
        # ... and its first injection's time, so that the first fault lands before the run gets far.
        if first_after_s is not None and first_after_s < 0:
            raise InputError(f"first_after_s must be >= 0, got {first_after_s}")
        self._first_after_s = first_after_s
        self._rng = random.Random(seed)
        self._clock = clock or RealClock()
        self._owns_http = http_client is None
        self._http = http_client or short_keepalive_client(timeout=HTTP_TIMEOUT_S)
        self._gate = RecoveryGate()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="random-fault-injector", daemon=True)
        self.injections: list[Injection] = []  # accepted injections, in order

    def start(self) -> None:
        self._thread.start()

    def stop_and_join(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            if self._owns_http:
                self._http.close()

    def _loop(self) -> None:
        if self._first_after_s is not None:
            next_time = self._clock.now() + self._first_after_s
        else:
            next_time = self._draw_next_time()
        while not self._clock.wait(self._stop, self._poll_interval):
            try:
                response = self._http.get(self._cells_url)
                response.raise_for_status()
                cells = CellList.model_validate(response.json()).items
            except Exception as exc:
                log.warning("injector: listing cells failed: %r", exc)
                continue
            # Observe on every poll, so a down→up cycle between sparse injections is not missed.
            self._gate.observe({c.metadata.name: c for c in cells})
            if self._clock.now() < next_time:
                continue
            alive = self._gate.genuinely_alive(cells)
            if len(alive) <= 1:
                log.debug("injector: %d genuinely alive cell(s); deferring", len(alive))
                continue
            target, mode = self._rng.choice(alive).metadata.name, self._rng.choice(self._modes)
            if self._first_mode is not None and not self.injections:
                mode = self._first_mode
            if self._inject(target, mode):
                next_time = self._draw_next_time()

    def _draw_next_time(self) -> float:
        return self._clock.now() + self._rng.expovariate(1.0 / self.mean_interval_s)

    def _inject(self, name: str, mode: FailureMode) -> bool:
        """POST the fault; on failure keep the schedule, so the next poll tries again."""
        try:
            response = self._http.post(f"{self._cells_url}/{name}/inject-fault",
                                       json={"mode": mode.value, "sub_index": 0})
            response.raise_for_status()
        except Exception as exc:
            log.warning("injector: injecting %s into %s failed: %r", mode.value, name, exc)
            return False
        self._gate.note_injected(name)
        self.injections.append(Injection(_dt.datetime.now(_dt.timezone.utc), name, mode))
        log.warning("injector: injected %s into %s (#%d)", mode.value, name, len(self.injections))
        return True
