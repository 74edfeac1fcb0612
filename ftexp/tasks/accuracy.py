"""Reading a run's eval accuracy back: the ``eval/<task>`` curve of a side, and its figures.

The driver writes one ``metrics.jsonl`` line per eval (``{"step": r, "attempt": 0, "eval/<task>": a}``,
step r = the rollout that policy generates next); the scenario's verdict and the sweep summary read
the curve from there. A run that stopped early simply has a shorter curve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ftexp.errors import RunDirError, one_line
from ftexp.rundir import METRICS_FILE


def eval_curves(side_root: Path, strict: bool = True) -> dict[str, list[tuple[int, float]]]:
    """``{eval key: [(step, accuracy)]}`` over every metrics file under ``side_root``, by step.

    ``strict``: a line that is not JSON is a RunDirError naming it; otherwise it is skipped.
    """
    latest: dict[str, dict[int, tuple[int, float]]] = {}
    for path in sorted(Path(side_root).glob(f"**/{METRICS_FILE}")):
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                row = json.loads(line)
                step, attempt = int(row["step"]), int(row["attempt"])
            except (ValueError, KeyError, TypeError) as e:
                if strict:
                    raise RunDirError(f"{path}:{lineno}: not a valid metrics line: {one_line(e)}") from e
                continue
            for key, value in row.items():
                if key.startswith("eval/") and (step not in latest.get(key, {}) or attempt >= latest[key][step][0]):
                    latest.setdefault(key, {})[step] = (attempt, float(value))
    return {key: [(step, value) for step, (_, value) in sorted(points.items())] for key, points in latest.items()}


@dataclass(frozen=True)
class Accuracy:
    """The figures of one accuracy curve."""

    key: str
    curve: list[tuple[int, float]]

    @property
    def start(self) -> float:
        return self.curve[0][1]

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    @property
    def best(self) -> tuple[int, float]:
        """(step, accuracy) of the best eval; the earliest on a tie."""
        return max(self.curve, key=lambda point: (point[1], -point[0]))

    def to_dict(self) -> dict:
        step, value = self.best
        return {"metric": self.key, "start": self.start, "best": value, "best_step": step, "final": self.final,
                "curve": [list(point) for point in self.curve]}


def side_accuracy(side_root: Path, strict: bool = True) -> Accuracy | None:
    """The side's eval accuracy (the first eval key, there is one per task), or None without evals."""
    curves = {key: curve for key, curve in eval_curves(side_root, strict).items() if curve}
    if not curves:
        return None
    key = sorted(curves)[0]
    return Accuracy(key, curves[key])
