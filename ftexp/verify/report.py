"""The verdict of one scenario run and the files that present it.

Each assertion a scenario makes becomes a ``CheckResult`` (name, passed, one-line summary, details).
A ``Verdict`` passes only if it holds at least one check and every check passed: a run that
checked nothing proves nothing. ``write_report`` renders the verdict as ``report.json`` (machine
readable) and ``report.md`` (first line ``# ftexp verdict: PASSED`` or ``FAILED``, a table of
checks, then per-check detail). ``plot_curves`` draws baseline-vs-target metric curves.

Only a verification that completed says PASSED or FAILED. A stage that could not finish one writes
``write_status_report``: ``ERROR`` (bad input, an unreadable file, a stage still running or that
died) or ``INTERRUPTED`` (SIGINT/SIGTERM), with the one-line cause, so that no old PASSED survives
beside results it no longer describes.

Check details are free-form dicts; a ``"kind"`` entry selects a richer markdown section:
``"dumps"`` (worst tensors), ``"metrics"`` (metric diff table), ``"reconfigure"`` (expected vs
actual events). Any other details are shown as JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ftexp.atomic_files import write_atomically, write_text_atomically
from ftexp.rundir import REPORT_JSON, REPORT_MD

_MAX_TABLE_ROWS = 50
_MAX_PLOTTED_KEYS = 6
# What a run dir's verdict files may say; only PASSED is a pass.
PASSED, FAILED, ERROR, INTERRUPTED = "PASSED", "FAILED", "ERROR", "INTERRUPTED"
VERDICT_HEADING = "# ftexp verdict: "


@dataclass
class CheckResult:
    name: str
    passed: bool
    summary: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "summary": self.summary, "details": self.details}


@dataclass
class Verdict:
    scenario: str
    mode: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def status(self) -> str:
        return PASSED if self.passed else FAILED

    def to_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "mode": self.mode,
            "passed": self.passed,
            "status": self.status,
            "checks": [c.to_dict() for c in self.checks],
        }


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("nan", "inf", "-inf"): strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_text_atomic(path: Path, text: str, *, in_place_fallback: bool = False) -> None:
    """Write ``text`` to ``path`` atomically (temp file + rename).

    ``in_place_fallback``: where the directory refuses new files (no write permission) but the
    file itself may be written, truncate and rewrite it in place instead. Not atomic, but it is
    the only way an unwritable run dir's old verdict can be taken back; used for ERROR and
    INTERRUPTED only. Raises the original OSError when neither works.
    """
    path = Path(path)
    try:
        write_text_atomically(path, text)
    except OSError:
        if not (in_place_fallback and path.is_file()):
            raise
        try:
            with open(path, "w") as f:  # no O_CREAT needed: the file exists
                f.write(text)
        except OSError:
            pass
        else:
            return
        raise


def status_of(report_md_first_line: str) -> str:
    """The status a report.md heading states ("" if it is not a verdict heading)."""
    line = report_md_first_line.strip()
    return line[len(VERDICT_HEADING):].strip() if line.startswith(VERDICT_HEADING) else ""


def write_status_report(run_dir: str | Path, status: str, cause: str, scenario: str, mode: str,
                        extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """``report.json`` and ``report.md`` for a verification that did not complete: ``status`` is
    ERROR or INTERRUPTED and ``cause`` the one line that says why. report.json first, report.md
    (what users read) last; each atomically, or in place where the run dir refuses new files."""
    if status in (PASSED, FAILED):
        raise ValueError(f"write_status_report is for runs without a verdict, not {status}")
    run_dir = Path(run_dir)
    payload = {"scenario": scenario, "mode": mode, "passed": False, "status": status, "cause": cause,
               "checks": [], "extra": extra or {}}
    json_path, md_path = run_dir / REPORT_JSON, run_dir / REPORT_MD
    lines = [f"{VERDICT_HEADING}{status}", "", _cell(cause), "", f"Scenario `{scenario}`, mode `{mode}`.", "",
             "The verification did not complete: nothing in this run directory is a verdict.", ""]
    if extra:
        lines += ["## Run", "", "```json", json.dumps(json_safe(extra), indent=2, default=str), "```", ""]
    write_text_atomic(json_path, json.dumps(json_safe(payload), indent=2, default=str) + "\n", in_place_fallback=True)
    write_text_atomic(md_path, "\n".join(lines), in_place_fallback=True)
    return json_path, md_path


def write_report(run_dir: str | Path, verdict: Verdict, extra: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``run_dir``; returns their paths."""
    run_dir = Path(run_dir)
    payload = {**verdict.to_dict(), "extra": extra or {}}
    json_path, md_path = run_dir / REPORT_JSON, run_dir / REPORT_MD
    json_text = json.dumps(json_safe(payload), indent=2, allow_nan=False, default=str) + "\n"
    md_text = render_markdown(verdict, extra or {})
    write_text_atomically(json_path, json_text)
    write_text_atomically(md_path, md_text)
    return json_path, md_path


# --- markdown ----------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif value is None:
        text = ""
    else:
        text = str(value)
    # A '|' or newline inside a cell would break the table row.
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows[:_MAX_TABLE_ROWS]]
    if len(rows) > _MAX_TABLE_ROWS:
        lines.append(f"\n({len(rows) - _MAX_TABLE_ROWS} more rows in report.json)")
    return lines


def _dump_section(details: dict[str, Any]) -> list[str]:
    lines = [f"Leaves: {len(details.get('leaves', []))}; counts: {details.get('counts', {})}", ""]
    worst = details.get("worst", [])
    if worst:
        lines += ["Worst tensors by rel:", ""]
        lines += _table(
            ["leaf", "tensor", "status", "rel", "max_abs", "mean_abs", "rule"],
            [[r["leaf"], r["name"], r["status"], r["rel"], r["max_abs"], r["mean_abs"],
              f"{r['rule']} → {r['predicate']}" if r.get("rule") else ""] for r in worst],
        )
    return lines


def _metric_section(details: dict[str, Any]) -> list[str]:
    # Mismatches first, so that a long table still shows what failed.
    rows = sorted(details.get("rows", []), key=lambda r: r["ok"])
    return _table(
        ["rollout", "key", "baseline", "target", "abs_diff", "rel_diff", "ok", "note"],
        [[r["rollout_id"], r["key"], r["baseline"], r["target"], r["abs_diff"], r["rel_diff"],
          "yes" if r["ok"] else "NO", r.get("note", "")] for r in rows],
    )


def _reconfigure_section(details: dict[str, Any]) -> list[str]:
    expected, actual = details.get("expected", []), details.get("actual", [])
    rows = []
    for i in range(max(len(expected), len(actual))):
        e = expected[i] if i < len(expected) else None
        a = actual[i] if i < len(actual) else None
        rows.append([i, json.dumps(e), json.dumps(a), "yes" if e == a else "NO"])
    return _table(["#", "expected", "actual", "equal"], rows)


_SECTIONS = {"dumps": _dump_section, "metrics": _metric_section, "reconfigure": _reconfigure_section}


def render_markdown(verdict: Verdict, extra: dict[str, Any]) -> str:
    lines = [f"{VERDICT_HEADING}{verdict.status}", "", f"Scenario `{verdict.scenario}`, mode `{verdict.mode}`.", ""]
    if not verdict.checks:
        lines += ["No checks ran: a verdict without checks is a failure.", ""]
    else:
        lines += _table(["check", "result", "summary"],
                        [[c.name, "PASSED" if c.passed else "FAILED", c.summary] for c in verdict.checks])
        lines.append("")
    for check in verdict.checks:
        lines += [f"## {check.name}: {'PASSED' if check.passed else 'FAILED'}", "", _cell(check.summary), ""]
        issues = check.details.get("issues") or []
        if issues:
            lines += ["Issues:", ""] + [f"- {_cell(i)}" for i in issues[:_MAX_TABLE_ROWS]] + [""]
        section = _SECTIONS.get(check.details.get("kind", ""))
        if section:
            lines += section(check.details)
        elif check.details:
            lines += ["```json", json.dumps(json_safe(check.details), indent=2), "```"]
        lines.append("")
    if extra:
        lines += ["## Run", "", "```json", json.dumps(json_safe(extra), indent=2, default=str), "```", ""]
    return "\n".join(lines)


# --- curves ------------------------------------------------------------------------------------


def plot_curves(baseline_series: dict[str, list[tuple[int, float]]], target_series: dict[str, list[tuple[int, float]]],
                path: str | Path, title: str, keys: Sequence[str] | None = None) -> list[str]:
    """Draw baseline vs target per metric key (one subplot each, at most 6) into a PNG.

    ``keys`` picks and orders the keys (default: all keys of either side, sorted). Returns the
    keys drawn. Uses matplotlib's object API with the Agg canvas, so no global backend or
    display is touched.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chosen = list(keys) if keys is not None else sorted(set(baseline_series) | set(target_series))
    chosen = chosen[:_MAX_PLOTTED_KEYS]
    fig = Figure(figsize=(6, 2.6 * max(1, len(chosen))), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    axes = fig.subplots(max(1, len(chosen)), 1, squeeze=False)[:, 0]
    for ax, key in zip(axes, chosen):
        for label, series, style in (("baseline", baseline_series, "-o"), ("target", target_series, "--x")):
            points = sorted(series.get(key, []))
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], style, label=label)
        ax.set_title(key)
        ax.set_xlabel("rollout")
        if ax.lines:
            ax.legend()
    if not chosen:
        axes[0].text(0.5, 0.5, "no metrics", ha="center", va="center")
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png"))
    return chosen
