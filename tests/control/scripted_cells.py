"""Scripted in-memory cell handles: stand-ins for the Ray-backed cells behind the control server.

A test sets each cell's lifecycle state and health tri-state directly and reads back the
calls the server made. The handles follow the real actor cell's rules: suspend stops (a no-op
when stopped), resume moves Stopped → Pending, and injection needs an alive cell and a valid
actor index.
"""

from __future__ import annotations

import threading
from typing import Callable

from ftexp.control.api_models import TriState
from ftexp.control.registry import CellRegistry, CellSnapshot, NotSupported, compute_cell_status
from ftexp.control.server import ControlServer
from ftexp.control.failure_modes import FailureMode


class ScriptedCell:
    def __init__(self, cell_type: str, index: int, state: str = "AllocatedAlive",
                 health: TriState = TriState.TRUE, num_actors: int = 1) -> None:
        self.cell_type, self.index, self.num_actors = cell_type, index, num_actors
        self.state, self.health = state, health
        self.calls: list[str] = []  # "suspend" / "resume", in order
        self.injected: list[tuple[FailureMode, int]] = []
        self.fail_patch = False  # suspend/resume raise, as a failing ray.kill would
        self.on_inject: Callable[["ScriptedCell"], None] | None = None
        self._lock = threading.Lock()

    def status(self) -> CellSnapshot:
        with self._lock:
            return compute_cell_status(self.state, self.health)

    def suspend(self) -> None:
        with self._lock:
            self.calls.append("suspend")
            if self.fail_patch:
                raise RuntimeError("ray.kill failed")
            self.state = "Stopped"

    def resume(self) -> None:
        with self._lock:
            self.calls.append("resume")
            if self.fail_patch:
                raise RuntimeError("start failed")
            if self.state == "Stopped":
                self.state = "Pending"

    def inject_fault(self, mode: FailureMode, sub_index: int) -> None:
        if self.cell_type == "rollout":
            raise NotSupported("rollout cells do not support fault injection")
        with self._lock:
            if self.state != "AllocatedAlive":
                raise RuntimeError(f"cell is {self.state}, not alive")
            if not 0 <= sub_index < self.num_actors:
                raise IndexError(f"sub_index {sub_index} out of range")
            self.injected.append((mode, sub_index))
        if self.on_inject is not None:
            self.on_inject(self)


def serve(*cells: ScriptedCell) -> ControlServer:
    """A started control server on a free 127.0.0.1 port over ``cells``; the caller stops it."""
    registry = CellRegistry()
    for cell in cells:
        registry.register(cell)
    server = ControlServer(registry)
    server.start()
    return server
