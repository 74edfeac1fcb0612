"""Scenarios: what a run must prove. One module per scenario; its yaml names the module.

A scenario module declares its ``KIND`` (``scenarios.base.Kind``: comparison or soak), checks that
its fault plan can prove what the scenario claims (``check_plan``, at config time) and verifies a
finished run directory (``verify``). Which sides train and whether the run is a soak is asked of
the loaded scenario, here, once.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ftexp.config import ExperimentConfig, ScenarioConfig
from ftexp.errors import InputError
from ftexp.scenarios.base import Kind
from ftexp.verify.report import CheckResult

def scenario_modules() -> list[str]:
    """The modules of this package that are scenarios: those that declare a ``KIND`` (the rest is machinery)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__)
                  if hasattr(importlib.import_module(f"{__name__}.{m.name}"), "KIND"))


@dataclass(frozen=True)
class Scenario:
    name: str
    module: ModuleType

    @property
    def kind(self) -> Kind:
        return self.module.KIND

    @property
    def is_soak(self) -> bool:
        return self.kind == Kind.soak

    @property
    def sides(self) -> tuple[str, ...]:
        return self.kind.sides

    def check_plan(self, cfg: ExperimentConfig) -> None:
        self.module.check_plan(cfg)

    def verify(self, cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
        return self.module.verify(cfg, run_dir)


def load_scenario(cfg: ScenarioConfig) -> Scenario:
    if cfg.module not in scenario_modules():
        raise InputError(f"scenario {cfg.name}: unknown scenario module {cfg.module!r} "
                         f"(modules: {', '.join(scenario_modules())})")
    return Scenario(cfg.name, importlib.import_module(f"{__name__}.{cfg.module}"))
