"""Scenario assertions: what must hold for a run of each scenario to pass.

The fault plan of a scenario lives in its config (``conf/scenario/<name>.yaml``); what the run
must prove lives here. Every phase is checked the same way — dumps tensor by tensor, metrics key
by key, the exact set of dump leaves, and the exact list of reconfigure events on each side — and
each scenario only says what it expects: which leaves, which reconfigurations (shrinks and heals
are the positive proof that the planned fault happened and the heal ran).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ftexp.config import ExperimentConfig, PhaseConfig
from ftexp.errors import InputError
from ftexp.scenarios.checks import check_phase
from ftexp.scenarios.expectations import EXPECTATIONS, PhaseExpectation
from ftexp.scenarios.soak import verify_soak
from ftexp.verify.report import CheckResult


def verify_run(cfg: ExperimentConfig, run_dir: Path) -> list[CheckResult]:
    if cfg.scenario.soak.enabled:
        return verify_soak(cfg, run_dir)
    expect: Callable[[ExperimentConfig, PhaseConfig], PhaseExpectation] | None = EXPECTATIONS.get(cfg.scenario.name)
    if expect is None:
        raise InputError(f"scenario {cfg.scenario.name!r} has no assertions defined in ftexp.scenarios")
    checks: list[CheckResult] = []
    for phase in cfg.scenario.phases:
        checks += check_phase(cfg, run_dir, phase, expect(cfg, phase))
    return checks
