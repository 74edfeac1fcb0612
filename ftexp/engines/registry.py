"""Which engine runs a mode: the one place that maps ``trainer.engine`` to its implementation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftexp.config import Engine as EngineKind
from ftexp.engines import megatron, torch

if TYPE_CHECKING:  # the protocol module imports torch; resolving an engine must not
    from ftexp.engines.base import Engine

# What a model may have that a threshold rule can be for (a dump rule's optional third element):
# a rule for a feature the run's model lacks may match no tensor; any other rule must match one.
MODEL_FEATURES = ("moe", "qk_norm")

_ENGINES: dict[EngineKind, "Engine"] = {EngineKind.torch: torch.ENGINE, EngineKind.megatron: megatron.ENGINE}


def get_engine(kind: EngineKind) -> "Engine":
    return _ENGINES[kind]
