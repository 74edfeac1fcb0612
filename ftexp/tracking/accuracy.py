"""The accuracy part of a sweep summary: each point's eval curve, tabled and drawn per crash probability.

For sweeps of an accuracy scenario (``scenario=realistic``): per point the task's eval accuracy at
the start (after the warm-up), its best and its last eval (read from the point's target metrics),
per crash probability the mean of those, and ``sweep_accuracy.png`` with one panel per crash
probability holding every point's accuracy curve. Points without evals (other scenarios, or a run
that died before its first eval) are left out of this part; the pass/fail table still counts them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

from ftexp.rundir import TARGET
from ftexp.tasks.accuracy import side_accuracy


def _seed(overrides: list[str]) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "seed"), "-")


def accuracy_points(sweep_dir: Path, rows: list[dict[str, Any]],
                    crash_probability_of: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    """Per sweep point with evals: job, crash probability, seed and the accuracy figures and curve."""
    points = []
    for row in rows:
        accuracy = side_accuracy(sweep_dir / str(row["job"]) / TARGET, strict=False)
        if accuracy is not None:
            points.append({"job": row["job"], "crash_probability": crash_probability_of(row),
                           "seed": _seed(row.get("overrides", [])), "passed": bool(row["passed"]),
                           **accuracy.to_dict()})
    return points


def render_accuracy(points: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the per-point table and the means per crash probability (none without points)."""
    if not points:
        return []
    lines = ["", f"Eval accuracy ({points[0]['metric']}; start: after the warm-up, before rollout 0):", "",
             "| job | crash probability | seed | start | best (before rollout) | final | verdict |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {p['job']} | {p['crash_probability']} | {p['seed']} | {p['start']:.3f} | {p['best']:.3f} "
              f"({p['best_step']}) | {p['final']:.3f} | {'PASSED' if p['passed'] else 'FAILED'} |" for p in points]
    by_p: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by_p[p["crash_probability"]].append(p)
    lines += ["", "| crash probability | points | mean start | mean best | mean final |", "|---|---|---|---|---|"]
    lines += [f"| {cp} | {len(ps)} | {statistics.mean(p['start'] for p in ps):.3f} "
              f"| {statistics.mean(p['best'] for p in ps):.3f} | {statistics.mean(p['final'] for p in ps):.3f} |"
              for cp, ps in sorted(by_p.items())]
    return lines


def plot_accuracy_curves(points: list[dict[str, Any]], path: Path) -> None:
    """One panel per crash probability, one curve per point (labelled by seed), on a shared y axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    by_p: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by_p[p["crash_probability"]].append(p)
    fig = Figure(figsize=(4 * max(1, len(by_p)), 3.5))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(by_p)), squeeze=False, sharey=True)[0]
    for ax, (cp, ps) in zip(axes, sorted(by_p.items())):
        for p in ps:
            steps, values = zip(*p["curve"])
            ax.plot(steps, values, "-o" if p["passed"] else "--x", label=f"seed {p['seed']} (job {p['job']})")
        ax.set_title(f"crash probability {cp}")
        ax.set_xlabel("rollout")
        ax.legend(fontsize="small")
    axes[0].set_ylabel(points[0]["metric"] if points else "accuracy")
    fig.tight_layout()
    fig.savefig(path)
