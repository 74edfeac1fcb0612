"""Which engine runs a mode: the one place that maps ``trainer.engine`` to its implementation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftexp.config import Engine as EngineKind
from ftexp.engines import megatron, torch

if TYPE_CHECKING:  # the protocol module imports torch; resolving an engine must not
    from ftexp.engines.base import Engine

_ENGINES: dict[EngineKind, "Engine"] = {EngineKind.torch: torch.ENGINE, EngineKind.megatron: megatron.ENGINE}


def get_engine(kind: EngineKind) -> "Engine":
    return _ENGINES[kind]
