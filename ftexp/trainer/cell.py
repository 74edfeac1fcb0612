"""A cell: one complete model replica (its own ranks, its own process world) and its lifecycle.

    Pending ──allocate──▶ Allocated ──init ok──▶ Alive ──call fails──▶ Errored ──▶ Stopped
       ▲                                                                            │
       └───────────────────────────────── start ────────────────────────────────────┘

A cell's ranks are handles onto its ranks' processes (``ftexp.trainer.cell_rank``: each node's rank
host serves the ranks placed there). Any failed call on a cell marks it Errored, kills its ranks and
waits until each is confirmed ended, so a failure always ends in Stopped. ``start`` moves a Stopped
cell back to Pending and already gets the next incarnation's ranks — a warm spare's, built long before
(``ftexp.trainer.spares``), or new ones whose processes their host starts in the background — so the
heal at the group's next refresh waits for as little start-up as possible; the cell stays Pending
(not yet part of any quorum) until that refresh allocates it.

Every rank runs a ``lifeline`` call that never returns: it fails the moment the rank's process ends
(or its host dies with its node), which lets the group notice a death between calls, not only at the
next one.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ftexp.trainer.quorum import IndepDPInfo

log = logging.getLogger(__name__)
CONFIRM_DEAD_DEADLINE_S = 120.0


class CellState(enum.Enum):
    PENDING = "Pending"
    ALLOCATED = "AllocatedUninitialized"
    ALIVE = "AllocatedAlive"
    ERRORED = "AllocatedErrored"
    STOPPED = "Stopped"


@dataclass
class Cell:
    index: int
    # (cell index, incarnation) -> rank handles, one per rank in the cell (a warm spare's, or new ones).
    # The incarnation counts the sets of ranks taken, so a restarted cell's ranks rendezvous apart from their predecessors.
    make_ranks: Callable[[int, int], list[Any]]
    state: CellState = CellState.PENDING
    ranks: list[Any] = field(default_factory=list)
    info: IndepDPInfo | None = None
    incarnation: int = 0
    lifelines: list[ray.ObjectRef] = field(default_factory=list)  # one pending ``lifeline`` call per rank

    # ---- transitions ------------------------------------------------------------------------
    def allocate(self) -> None:
        """Pending → Allocated: take the ranks ``start`` created, or create them now (the first start)."""
        self._expect(CellState.PENDING)
        if not self.ranks:
            self._create_ranks()
        self.state = CellState.ALLOCATED

    def _create_ranks(self) -> None:
        self.incarnation += 1
        self.ranks = self.make_ranks(self.index, self.incarnation)
        self.lifelines = [rank.lifeline.remote() for rank in self.ranks]

    def mark_alive(self, info: IndepDPInfo) -> None:
        self._expect(CellState.ALLOCATED, CellState.ALIVE)
        self.state, self.info = CellState.ALIVE, info

    def mark_errored(self) -> None:
        self._expect(CellState.ALLOCATED, CellState.ALIVE, CellState.ERRORED)
        self.state = CellState.ERRORED

    def stop(self) -> None:
        """Kill the ranks (no wait; a Pending cell's early-started ones too) and become Stopped (a no-op if it is)."""
        if self.state == CellState.STOPPED:
            log.info("cell %d already stopped", self.index)
            return
        for rank in self.ranks:
            rank.kill()
        self.state, self.info = CellState.STOPPED, None

    def start(self) -> None:
        """Stopped → Pending, creating the next incarnation's ranks; a no-op from any other state."""
        if self.state != CellState.STOPPED:
            log.info("cell %d is %s; start is a no-op", self.index, self.state.value)
            return
        self._create_ranks()
        self.state = CellState.PENDING

    # ---- calls --------------------------------------------------------------------------------
    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [getattr(rank, method).remote(*args, **kwargs) for rank in self.ranks]

    def collect(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Wait for every rank's result; on any failure: Errored → kill → confirm ended → re-raise."""
        try:
            return get_failing_fast(refs)
        except Exception:
            self.fail()
            raise

    def fail(self) -> None:
        """A call on this cell failed: Errored → kill every rank → confirm dead."""
        if self.state in (CellState.STOPPED, CellState.PENDING):
            return  # the control plane already stopped (and maybe restarted) it mid-call
        self.mark_errored()
        self.stop_and_confirm_dead()

    def execute(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self.collect(self.submit(method, *args, **kwargs))

    def stop_and_confirm_dead(self) -> None:
        handles = list(self.ranks)
        self.stop()
        deadline = time.monotonic() + CONFIRM_DEAD_DEADLINE_S
        for handle in handles:
            while True:
                try:
                    ray.get(handle.ping.remote(), timeout=1.0)
                except (RayActorError, RayTaskError):
                    break  # confirmed dead: the rank's process ended (or its host died)
                except GetTimeoutError:
                    pass
                if time.monotonic() > deadline:
                    log.error("cell %d: a rank not confirmed dead after %.0fs; going on", self.index,
                              CONFIRM_DEAD_DEADLINE_S)
                    break
                time.sleep(0.05)

    def _expect(self, *states: CellState) -> None:
        assert self.state in states, f"cell {self.index}: {self.state.value} not in {[s.value for s in states]}"

    @property
    def is_alive(self) -> bool:
        return self.state == CellState.ALIVE


def get_failing_fast(refs: list[ray.ObjectRef]) -> list[Any]:
    """``ray.get(refs)``, but raising as soon as any call fails rather than when its turn comes.

    A dead rank's peers are often blocked in a collective with it: waiting on them first would
    only find the death after their timeout.
    """
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)
