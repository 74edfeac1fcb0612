"""What kind of run a scenario is; the one place that says which sides train and how it is judged.

``comparison``: a baseline (plain DP) and a target (fault-tolerant cells) train the same rollouts,
and the target must match the baseline tensor by tensor. ``soak``: only the target trains, under
random faults, and must finish with the audit trail intact.
"""

from __future__ import annotations

import enum

from ftexp.rundir import BASELINE, TARGET


class Kind(enum.Enum):
    comparison = "comparison"
    soak = "soak"

    @property
    def sides(self) -> tuple[str, ...]:
        """The sides a run of this kind trains, in order."""
        return (BASELINE, TARGET) if self == Kind.comparison else (TARGET,)
