"""The control plane wired to a live train group: handles, heartbeat checkers, server, controller.

``ControlPlane(group, cfg)`` registers one ``actor-<i>`` handle per cell, starts one heartbeat
health checker per cell (liveness = "every rank answered ``heartbeat`` in time"; a cell blocked
in a cross-cell collective still answers, since heartbeats run in their own Ray concurrency
group), serves the HTTP API on 127.0.0.1, and runs the mini FT controller that suspends and
resumes unhealthy cells. Resuming only marks a cell Pending: the group's next refresh heals it
(from a warm spare's ranks where ``trainer.spare_cells`` keeps some, without waiting for a process start).

The server and controller threads act on the group while the training loop runs, like the
reference: a suspend mid-step shows up as failed calls in that step.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from ftexp.control.clock import RealClock
from ftexp.control.controller import MiniFTController
from ftexp.control.health import SimpleHealthChecker
from ftexp.control.registry import CellRegistry, CellSnapshot, compute_cell_status
from ftexp.control.server import ControlServer
from ftexp.control.failure_modes import FailureMode

log = logging.getLogger(__name__)


class ActorCellHandle:
    """One train cell as the control server sees it."""

    cell_type = "actor"

    def __init__(self, group, index: int, checker: SimpleHealthChecker):
        self.group, self.index, self.checker = group, index, checker

    def status(self) -> CellSnapshot:
        return compute_cell_status(self.group.cells[self.index].state.value, self.checker.status)

    def suspend(self) -> None:
        self.group.stop_cell(self.index, by="control_plane")

    def resume(self) -> None:
        self.group.start_cell(self.index, by="control_plane")

    def inject_fault(self, mode: FailureMode, sub_index: int) -> None:
        cell = self.group.cells[self.index]
        if not cell.is_alive or not 0 <= sub_index < len(cell.ranks):
            raise RuntimeError(f"cell {self.index} is {cell.state.value} with {len(cell.ranks)} ranks")
        cell.ranks[sub_index].inject_fault.remote(mode.value)  # fire and forget


def _heartbeat_check(group, index: int, timeout: float):
    def check() -> None:
        cell = group.cells[index]
        if not cell.is_alive:  # nothing to probe; the reported status ignores the checker then
            return
        ray.get([a.heartbeat.remote() for a in cell.ranks], timeout=timeout)
    return check


class ControlPlane:
    def __init__(self, group, cfg: Any):
        self.group, self.cfg = group, cfg
        self.registry = CellRegistry()
        self.checkers = []
        for cell in group.cells:
            checker = SimpleHealthChecker(_heartbeat_check(group, cell.index, cfg.heartbeat_timeout_s),
                                          interval=cfg.heartbeat_interval_s, timeout=cfg.heartbeat_timeout_s,
                                          first_wait=cfg.heartbeat_first_wait_s,
                                          failure_threshold=cfg.heartbeat_failure_threshold,
                                          clock=RealClock(), name=f"actor-{cell.index}")
            self.checkers.append(checker)
            self.registry.register(ActorCellHandle(group, cell.index, checker))
        self.server = ControlServer(self.registry, host=cfg.host, port=cfg.port)
        self.controller: MiniFTController | None = None
        self._controller_thread: threading.Thread | None = None

    def start(self) -> int:
        port = self.server.start()
        for checker in self.checkers:
            checker.start()
        if self.cfg.controller:
            self.controller = MiniFTController(self.server.base_url, poll_interval=self.cfg.controller_poll_interval_s,
                                               resume_delay=self.cfg.controller_resume_delay_s, clock=RealClock())
            self._controller_thread = threading.Thread(target=self.controller.run, name="mini-ft-controller",
                                                       daemon=True)
            self._controller_thread.start()
        log.info("control server on %s (controller %s)", self.server.base_url, "on" if self.cfg.controller else "off")
        return port

    def pause_health(self, indices: list[int]) -> None:
        """A heal pauses the checkers of the cells it heals; resuming re-applies the first wait.

        The other cells' checkers keep probing through the reconfigure: their heartbeats are served
        beside it, and a member frozen in it is found only by them.
        """
        for index in indices:
            self.checkers[index].pause()

    def resume_health(self, indices: list[int]) -> None:
        for index in indices:
            self.checkers[index].resume()

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.request_stop()
            self._controller_thread.join(timeout=self.cfg.controller_resume_delay_s + 5)
        for checker in self.checkers:
            checker.stop()
        self.server.stop()
