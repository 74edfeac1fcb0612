"""The mini FT controller: polls the control server and heals unhealthy cells.

Each poll lists the cells and classifies each one:

    a Healthy condition with status False  → UNHEALTHY
    else phase Suspended                   → UNHEALTHY   (a cell the train side shrank out)
    else no Healthy condition (Pending)    → NOT_APPLICABLE
    else (Healthy True or Unknown)         → HEALTHY     (Unknown is not healed)

Healing an UNHEALTHY cell is suspend, wait ``resume_delay``, resume: the suspend kills whatever
is left of it, and the resume marks it pending so the next refresh re-creates and heals it.
Heals are rate-limited per cell: after a success the cell cools down for ``resume_delay``;
after the n-th consecutive failure it waits ``min(5 * 2**n, 300)`` seconds (10, 20, 40, … 300).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass

import httpx

from ftexp.control.api_models import Cell, CellList, TriState
from ftexp.control.clock import Clock, RealClock
from ftexp.http_client import short_keepalive_client

log = logging.getLogger(__name__)
HTTP_TIMEOUT_S = 30.0
BACKOFF_BASE_S = 5.0
BACKOFF_CAP_S = 300.0


class CellHealth(enum.Enum):
    UNHEALTHY = "Unhealthy"
    NOT_APPLICABLE = "NotApplicable"
    HEALTHY = "Healthy"


def classify_cell(cell: Cell) -> CellHealth:
    healthy = [c for c in cell.status.conditions if c.type == "Healthy"]
    if any(c.status == TriState.FALSE for c in healthy):
        return CellHealth.UNHEALTHY
    if cell.status.phase == "Suspended":
        return CellHealth.UNHEALTHY
    if not healthy:
        return CellHealth.NOT_APPLICABLE
    return CellHealth.HEALTHY


def backoff_seconds(consecutive_failures: int) -> float:
    return min(BACKOFF_BASE_S * 2 ** consecutive_failures, BACKOFF_CAP_S)


@dataclass
class HealBackoff:
    consecutive_failures: int = 0
    next_attempt_at: float = 0.0


class MiniFTController:
    def __init__(self, base_url: str, poll_interval: float = 10.0, resume_delay: float = 10.0,
                 clock: Clock | None = None, http_client: httpx.Client | None = None) -> None:
        self._cells_url = f"{base_url.rstrip('/')}/api/v1/cells"
        self._poll_interval, self._resume_delay = poll_interval, resume_delay
        self._clock = clock or RealClock()
        self._owns_http = http_client is None
        self._http = http_client or short_keepalive_client(timeout=HTTP_TIMEOUT_S)
        self._stop = threading.Event()
        self.backoff: dict[str, HealBackoff] = {}  # cell name → record, only for cells currently unhealthy

    def run(self) -> None:
        """Poll every ``poll_interval`` (less the poll's own duration) until ``request_stop``."""
        try:
            while not self._stop.is_set():
                started = self._clock.now()
                self.poll_once()
                if self._clock.wait(self._stop, self._poll_interval - (self._clock.now() - started)):
                    return
        finally:
            if self._owns_http:
                self._http.close()

    def request_stop(self) -> None:
        self._stop.set()

    def poll_once(self) -> None:
        """One poll; any error is logged and swallowed so the loop keeps going."""
        try:
            self._poll()
        except Exception:
            log.exception("mini FT controller poll failed")

    def _poll(self) -> None:
        response = self._http.get(self._cells_url)
        response.raise_for_status()
        cells = CellList.model_validate(response.json()).items
        unhealthy = [c.metadata.name for c in cells if classify_cell(c) is CellHealth.UNHEALTHY]
        for name in set(self.backoff) - set(unhealthy):
            del self.backoff[name]
        for name in unhealthy:
            record = self.backoff.setdefault(name, HealBackoff())
            if self._clock.now() < record.next_attempt_at:
                continue
            try:
                self._heal(name)
            except Exception as exc:
                record.consecutive_failures += 1
                delay = backoff_seconds(record.consecutive_failures)
                record.next_attempt_at = self._clock.now() + delay
                log.warning("healing cell %s failed (%r); retry in %.0fs", name, exc, delay)
            else:
                record.consecutive_failures = 0
                record.next_attempt_at = self._clock.now() + self._resume_delay

    def _heal(self, name: str) -> None:
        log.warning("healing cell %s: suspend, wait %.0fs, resume", name, self._resume_delay)
        self._patch_suspend(name, True)
        # Not interruptible by request_stop: stopping here would leave the cell suspended for good.
        self._clock.sleep(self._resume_delay)
        self._patch_suspend(name, False)

    def _patch_suspend(self, name: str, suspend: bool) -> None:
        self._http.patch(f"{self._cells_url}/{name}", json={"spec": {"suspend": suspend}}).raise_for_status()
