"""Wire models of the control server's Kubernetes-flavoured API.

Field names are the JSON names (camelCase where Kubernetes uses it) so a model reads like the
body it validates. Every model forbids unknown fields; FastAPI answers violations with its
standard 422 body. Request fields are strict, so ``"suspend": "yes"`` is a 422 rather than a
silent suspend.
"""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ftexp.control.failure_modes import FailureMode

API_VERSION = "miles.io/v1"
CELL_TYPE_LABEL = "miles.io/cell-type"
CELL_INDEX_LABEL = "miles.io/cell-index"

CellType = Literal["actor", "rollout"]
Phase = Literal["Pending", "Running", "Suspended"]


class TriState(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class CellCondition(_Model):
    type: Literal["Allocated", "Healthy", "Initialized"]
    status: TriState
    reason: str | None = None
    message: str | None = None
    lastTransitionTime: str | None = None


class CellLabels(_Model):
    cell_type: CellType = Field(alias=CELL_TYPE_LABEL)
    cell_index: str = Field(alias=CELL_INDEX_LABEL)


class CellMetadata(_Model):
    name: str
    labels: CellLabels


class CellSpec(_Model):
    suspend: bool


class CellStatus(_Model):
    phase: Phase
    conditions: list[CellCondition]


class Cell(_Model):
    apiVersion: Literal["miles.io/v1"] = API_VERSION
    kind: Literal["Cell"] = "Cell"
    metadata: CellMetadata
    spec: CellSpec
    status: CellStatus


class CellList(_Model):
    apiVersion: Literal["miles.io/v1"] = API_VERSION
    kind: Literal["CellList"] = "CellList"
    items: list[Cell]


class Status(_Model):
    """The Kubernetes error body."""

    apiVersion: Literal["v1"] = "v1"
    kind: Literal["Status"] = "Status"
    status: Literal["Failure"] = "Failure"
    message: str
    reason: str
    code: int


class OkResponse(_Model):
    """The body of a successful health probe or fault injection."""

    status: Literal["ok"] = "ok"


class PatchCellSpec(_Model):
    suspend: StrictBool | None = None


class PatchCellRequest(_Model):
    spec: PatchCellSpec | None = None


class InjectFaultRequest(_Model):
    mode: FailureMode
    sub_index: StrictInt = 0
