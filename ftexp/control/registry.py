"""What the control server serves: named cell handles, and how a cell's state reads as status.

A ``CellHandle`` adapts one cell (an actor cell of the train group, or a rollout cell) to the
API: it reports its status and carries out suspend / resume / fault injection. The
``CellRegistry`` keeps the handles in registration order under unique names
``<cell-type>-<index>``. ``compute_cell_status`` is the one translation from the cell
lifecycle state plus the health checker's tri-state to phase, conditions and ``spec.suspend``.

A restarted cell reads ``Healthy=True`` while it waits for its heal (nothing to probe yet), but it
holds no model state: ``Initialized=False`` says so, and turns True once the heal has loaded its
state. Whoever must not take the last cell with state away (the random injector) reads it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from ftexp.control.api_models import CellCondition, CellType, Phase, TriState
from ftexp.control.failure_modes import FailureMode


class NotSupported(Exception):
    """The handle cannot do this at all (e.g. fault injection into a rollout cell); the API answers 400."""


class CellSnapshot(NamedTuple):
    phase: Phase
    conditions: list[CellCondition]
    suspended: bool


class CellHandle(Protocol):
    @property
    def cell_type(self) -> CellType: ...

    @property
    def index(self) -> int: ...

    def status(self) -> CellSnapshot: ...

    def suspend(self) -> None:
        """Stop the cell (kill its ranks). Must be a no-op on a stopped cell."""

    def resume(self) -> None:
        """Mark a stopped cell pending; the real start happens at the next refresh."""

    def inject_fault(self, mode: FailureMode, sub_index: int) -> None:
        """Fire-and-forget ``mode`` into the cell's rank or engine ``sub_index``; raise ``NotSupported`` or any
        error."""


def cell_name(handle: CellHandle) -> str:
    return f"{handle.cell_type}-{handle.index}"


class CellRegistry:
    def __init__(self) -> None:
        self._handles: dict[str, CellHandle] = {}  # insertion order is the listing order

    def register(self, handle: CellHandle) -> None:
        name = cell_name(handle)
        if name in self._handles:
            raise ValueError(f"cell {name!r} is already registered")
        self._handles[name] = handle

    def handles(self) -> list[CellHandle]:
        return list(self._handles.values())

    def get(self, name: str) -> CellHandle | None:
        return self._handles.get(name)


def _condition(type_: str, status: TriState, reason: str | None = None) -> CellCondition:
    return CellCondition(type=type_, status=status, reason=reason)


_HEALTH_REASON = {TriState.TRUE: None, TriState.FALSE: "HealthCheckFailed", TriState.UNKNOWN: "HealthCheckUnknown"}


def compute_cell_status(state_name: str, health: TriState) -> CellSnapshot:
    """The control API's phase and conditions of a cell in ``state_name`` (a ``ftexp.trainer.cell.CellState`` value).

    An alive cell reports the checker's tri-state as is: ``Unknown`` stays ``Unknown`` (not
    ``True``) so nobody mistakes "not probed yet" for "probed and fine".
    """
    allocated = _condition("Allocated", TriState.TRUE)
    if state_name == "AllocatedAlive":
        return CellSnapshot("Running", [allocated, _condition("Healthy", health, _HEALTH_REASON[health]),
                                        _condition("Initialized", TriState.TRUE)], False)
    if state_name == "AllocatedUninitialized":
        # Still initialising: the checker has nothing to probe yet, and the cell has no state to give.
        return CellSnapshot("Running", [allocated, _condition("Healthy", TriState.TRUE),
                                        _condition("Initialized", TriState.FALSE, "AwaitingHeal")], False)
    if state_name == "AllocatedErrored":
        return CellSnapshot("Running", [allocated, _condition("Healthy", TriState.FALSE, "ExecutionErrored")], False)
    if state_name == "Pending":
        return CellSnapshot("Pending", [_condition("Allocated", TriState.FALSE)], False)
    if state_name == "Stopped":
        return CellSnapshot("Suspended", [_condition("Allocated", TriState.FALSE)], True)
    raise ValueError(f"unknown cell state {state_name!r}")
