"""Sweep summary: after ``python -m ftexp -m ...``, one table over every sweep point.

A Hydra callback (registered in ``conf/config.yaml``) runs when the multirun ends. It reads each
point's ``result.json`` and writes ``sweep_summary.json``, ``sweep_summary.md`` and
``sweep_summary.png`` (pass rate per crash probability) into the sweep dir. A point passes only if
its result file says PASSED: one whose verification did not complete (ERROR, INTERRUPTED), one that
left no result file (its job died) or an unreadable one is a row that did not pass, never a missing one.
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
            "passed": sum(r["passed"] for r in rows), "total": len(rows)}


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


def write_summary(sweep_dir: Path, num_jobs: int) -> dict[str, Any]:
    summary = summarize(sweep_dir, num_jobs)
    (sweep_dir / "sweep_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (sweep_dir / "sweep_summary.md").write_text(render_markdown(summary))
    plot_pass_rate(summary, sweep_dir / "sweep_summary.png")
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
