"""Sweep summary: after ``python -m ftexp -m ...``, one table over every sweep point.

A Hydra callback (registered in ``conf/config.yaml``) runs when the multirun ends. It reads each
point's ``result.json`` and writes ``sweep_summary.json``, ``sweep_summary.md`` and
``sweep_summary.png`` (pass rate per crash probability) into the sweep dir. A point passes only if
its result file says PASSED: one whose verification did not complete (ERROR, INTERRUPTED), one that
left no result file (its job died) or an unreadable one is a row that did not pass, never a missing one.

Soak points also bring their injections: per crash probability, the injections of all its points
are pooled into the recovery figures per fault kind and overall (median / max detection and
recovery, degraded rollouts per injection), tabled in the summary and plotted against the crash
probability in ``sweep_recovery.png``. Points of an accuracy scenario also bring their eval accuracy
(``ftexp.tracking.accuracy``): start, best and final per point, and their curves per crash
probability in ``sweep_accuracy.png``.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ftexp.rundir import RESULT_FILE
from ftexp.scenarios.ft_random import figures_by_kind, recovery_figures
from ftexp.tracking.accuracy import accuracy_points, plot_accuracy_curves, render_accuracy
from ftexp.tracking.result import result_passed

log = logging.getLogger("ftexp")


def _crash_probability(overrides: list[str]) -> str:
    for o in overrides:
        if o.split("=", 1)[0].endswith("crash_probability"):
            return o.split("=", 1)[1]
    return "-"


def summarize(sweep_dir: Path, num_jobs: int) -> dict[str, Any]:
    rows = []
    for num in range(num_jobs):
        point = sweep_dir / str(num)
        path = point / RESULT_FILE
        result, problem = None, "no result file"
        if path.is_file():
            try:
                result = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                problem = f"unreadable result file: {type(e).__name__}: {e}"
            if not isinstance(result, dict):
                result, problem = None, "unreadable result file: not a JSON object"
        if result is not None:
            passed = result_passed(result)
            status = "PASSED" if passed else str(result.get("status") or "FAILED").replace("PASSED", "FAILED")
            rows.append({"job": num, **result, "passed": passed, "status": status})
        else:
            overrides_file = point / ".hydra" / "overrides.yaml"
            rows.append({"job": num, "run_dir": str(point), "passed": False, "status": "ERROR",
                         "failed_checks": [problem],
                         "overrides": overrides_file.read_text().split("\n") if overrides_file.is_file() else []})
    by_p: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        by_p[_crash_probability(row.get("overrides", []))].append(bool(row["passed"]))
    pass_rate = {p: sum(v) / len(v) for p, v in sorted(by_p.items())}
    return {"sweep_dir": str(sweep_dir), "points": rows, "pass_rate_by_crash_probability": pass_rate,
            "recovery_by_crash_probability": _recovery_by_crash_probability(rows),
            "accuracy": accuracy_points(sweep_dir, rows, lambda row: _crash_probability(row.get("overrides", []))),
            "passed": sum(r["passed"] for r in rows), "total": len(rows)}


def _recovery_by_crash_probability(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Crash probability -> {"all": figures, <fault kind>: figures} over the pooled injections of its soak points."""
    pooled: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        soak = row.get("soak")
        if isinstance(soak, dict):
            pooled[_crash_probability(row.get("overrides", []))] += soak.get("injections", [])
    return {p: {"all": recovery_figures(injections), **figures_by_kind(injections)}
            for p, injections in sorted(pooled.items()) if injections}


def render_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# ftexp sweep: {summary['passed']}/{summary['total']} points PASSED", "",
             "| job | overrides | verdict | injections | heals | train/loss | wall s |", "|---|---|---|---|---|---|---|"]
    for r in summary["points"]:
        loss = r.get("final_metrics", {}).get("train/loss")
        lines.append(f"| {r['job']} | `{' '.join(r.get('overrides', []))}` | {r['status']} "
                     f"| {r.get('injections', '-')} | {r.get('heals', '-')} | {'-' if loss is None else f'{loss:.6g}'} "
                     f"| {r.get('wall_time_s', '-')} |")
    lines += ["", "| crash probability | pass rate |", "|---|---|"]
    lines += [f"| {p} | {rate:.0%} |" for p, rate in summary["pass_rate_by_crash_probability"].items()]
    recovery = summary["recovery_by_crash_probability"]
    if recovery:
        lines += ["", "Recovery per injection, pooled over each crash probability's soak points (seconds from the "
                  "injection; degraded: rollouts trained with fewer cells than configured):", "",
                  "| crash probability | fault kind | injections | detection median / max | recovery median / max "
                  "| degraded rollouts mean / max |", "|---|---|---|---|---|---|"]
        lines += [f"| {p} | {kind} | {f['injections']} | {f['median_detection_s']} / {f['max_detection_s']} "
                  f"| {f['median_recovery_s']} / {f['max_recovery_s']} "
                  f"| {f['mean_degraded_rollouts']} / {f['max_degraded_rollouts']} |"
                  for p, kinds in recovery.items() for kind, f in kinds.items()]
    lines += render_accuracy(summary.get("accuracy", []))
    return "\n".join(lines) + "\n"


def plot_pass_rate(summary: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rates = summary["pass_rate_by_crash_probability"]
    fig = Figure(figsize=(5, 3))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar(list(rates), [100 * v for v in rates.values()])
    ax.set_xlabel("crash probability")
    ax.set_ylabel("pass rate (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{summary['passed']}/{summary['total']} sweep points passed")
    fig.tight_layout()
    fig.savefig(path)


def _as_number(crash_probability: str) -> float | None:
    try:
        return float(crash_probability)
    except ValueError:
        return None


def plot_recovery(summary: dict[str, Any], path: Path) -> None:
    """Detection and recovery (median solid, max dashed) per fault kind against the crash probability."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    recovery = {p: kinds for p, kinds in summary["recovery_by_crash_probability"].items() if _as_number(p) is not None}
    fig = Figure(figsize=(9, 3.5))
    FigureCanvasAgg(fig)
    kinds = sorted({kind for kinds in recovery.values() for kind in kinds}, key=lambda k: (k != "all", k))
    for column, (key, title) in enumerate((("detection_s", "detection"), ("recovery_s", "recovery (healed back)"))):
        ax = fig.add_subplot(1, 2, column + 1)
        for n, kind in enumerate(kinds):
            points = sorted(((_as_number(p), kinds_of_p[kind]) for p, kinds_of_p in recovery.items()
                             if kind in kinds_of_p), key=lambda point: point[0])
            color = f"C{n}"
            for stat, style in (("median", "-o"), ("max", "--x")):
                xs = [x for x, f in points if f[f"{stat}_{key}"] is not None]
                ys = [f[f"{stat}_{key}"] for _, f in points if f[f"{stat}_{key}"] is not None]
                ax.plot(xs, ys, style, color=color, label=f"{kind} {stat}" if column == 0 else None)
        ax.set_xlabel("crash probability")
        ax.set_ylabel("seconds after the injection")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
    if kinds:
        fig.legend(loc="center right", fontsize="small")
        fig.subplots_adjust(right=0.78, wspace=0.3, bottom=0.15)
    fig.savefig(path)


def write_summary(sweep_dir: Path, num_jobs: int) -> dict[str, Any]:
    summary = summarize(sweep_dir, num_jobs)
    (sweep_dir / "sweep_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (sweep_dir / "sweep_summary.md").write_text(render_markdown(summary))
    plot_pass_rate(summary, sweep_dir / "sweep_summary.png")
    if summary["recovery_by_crash_probability"]:
        plot_recovery(summary, sweep_dir / "sweep_recovery.png")
    if summary["accuracy"]:
        plot_accuracy_curves(summary["accuracy"], sweep_dir / "sweep_accuracy.png")
    log.info("sweep: %d/%d points passed — %s", summary["passed"], summary["total"], sweep_dir / "sweep_summary.md")
    return summary


class SweepSummaryCallback(Callback):
    # The summary of the multirun that just ended, for the exit code (1 if any point failed).
    last_summary: dict[str, Any] | None = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        # Sweep points live in numbered subdirs (hydra.sweep.subdir = job number).
        SweepSummaryCallback.last_summary = write_summary(
            sweep_dir, len([p for p in sweep_dir.iterdir() if p.name.isdigit()]))


def sweep_exit_code() -> int | None:
    """For the multirun that just ended: 1 if any point failed, 0 if all passed; None without one."""
    summary = SweepSummaryCallback.last_summary
    if summary is None:
        return None
    return 0 if summary["passed"] == summary["total"] else 1
