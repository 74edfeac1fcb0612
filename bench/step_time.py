"""Benchmark: what fault tolerance costs per step, where the cost goes, and how fast a crash heals.

For each mode it runs ``python -m ftexp mode=<mode> scenario=no_failure`` twice — audits on (the
default: witness ids and per-step weight checksums) and off (``trainer.audit=false``, what a
production run would use) — and prints, from the runs' ``perf.jsonl`` files, the median wall time
of a committed rollout on each side (rollout 0 is warm-up and skipped), their ratio, and the
target step's breakdown as its ranks and driver measured it (medians over rollouts, max over
cells): compute (forward/backward/optimizer), cross-cell reduce, weight checksums, witness
bookkeeping, event writes, the driver's analyzer, and the rest of the driver's round trip (Ray
calls, refresh; consecutive rollouts train in one call per rank, and the round trip falls on the first
rollout of each such run), with the baseline's ranks' compute, reduce,
witness and dump sections beside it. Wall ratios follow the machine's load, which on a shared machine changes between
the baseline's rollouts and the target's; so each side's CPU seconds per committed rollout are
reported too (its ranks' processes, plus the target's driver; Ray's own daemons not counted), with
their ratio, and the load average at the start of each run. ``--heal`` adds ``with_failure`` runs
per mode, without and with one warm spare (``trainer.spare_cells=1``), ``--heal-repeats`` runs each (the
row is the median run by transfer rate, with that rate's range): crash → detect → shrink,
and the heal's start request → allocate → configure → transfer → load → first commit, and the transfer's
rate over a raw loopback socket copy of the same bytes (``loopback_copy.py``): on one connection, and
split over as many connections as the heal used (one per rank pair), all at once.
A run whose verdict failed is timed all the same (it trained every rollout) and its row names the failed
checks; a run that ended without a verdict becomes a row saying so, and the bench goes on.
A run's two sides train at once, taking turns at the machine, ``--turn-s`` seconds each (``taking_turns.py``):
one after the other they saw two different machines, since this shared VM's speed drifts by 10-20 % for minutes
at a time, and by 2x between runs of a second. A step's time counts only while its side ran. So that every side
trains for several turns, the small torch models' runs train ``--small-rollouts`` (128; a side ~8 s), the
~1 s/step model's and megatron modes' ``--rollouts`` (16). Even so a run's ratio moves by several percent: two
runs of the same side, taking turns, measured up to 7 % apart, their CPU per step as far, so some of that
spread is each run's own. Each configuration therefore runs ``--repeats`` times and the row gives the median run
(by wall ratio) with the range of both ratios over the repeats, and the ratio of each side's fastest run (noise
only ever adds time). The repeats alternate which side starts and takes its turn (or trains)
first, the baseline in the first, so that what goes first does not always fall on the same side.
A configuration's repeats train on the same rollouts, recorded once before them.
``--large`` trains a torch model big enough that a step takes about a second on a 2-core CPU,
so fixed costs and per-byte costs show apart; with ``--heal``, a megatron mode also heals a model with
~15x the bytes of its own (``wide_moe_5layer``), whose transfer is mostly bytes, not per-message costs.
A last table holds the run's figures against the bounds fault tolerance is held to (step ratios; with a
spare, the crash → the next commit, the cell's restart → its first commit, and the crash → the commit with
the cell back less the two rollouts' training it spans in this plan, the whole way shown beside it; transfer
rate), each marked met or not. Everything of one invocation
runs on the same machine, its run dirs in memory (``/dev/shm``) where the host has it, so that no side's
dumps wait on the disk writing back the other's; results go to ``bench/results/<name>.json`` and ``.md``
(``latest.md`` too).
Both sides' ranks fork from a process that imported torch and megatron-core once (the baseline's
multiprocessing fork server, the target's fork server per node), as every run starts them: ranks
that share their importer's pages run measurably cheaper steps than fresh interpreters (~15 % of CPU on
megatron's baseline, ``results/2026-12-04_megatron_cpu_gap.md``), so the two sides start alike.

    python bench/step_time.py                              # dp2 and dp4, 128 rollouts, 3 runs each
    python bench/step_time.py --modes dp2 --heal --large   # + heal timings + a ~1 s/step model
    python bench/step_time.py --modes dp2_cp2_tp2_ep2 --heal-only --large   # megatron heals, its model and a wide one
    python bench/step_time.py --modes dp2_cp2_tp2_ep2 --audit off --repeats 5   # one bound, more repeats
    python bench/step_time.py --modes dp2_cp2_tp2_ep2 dp2_cp2_pp2 dp4_cp2 --rollouts 12   # megatron cells
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

import yaml
from loopback_copy import loopback_bytes_per_s
from taking_turns import SideTurns, process_tree, take_turns

RESULTS = Path(__file__).parent / "results"
MODES = Path(__file__).parent.parent / "conf" / "mode"
# A torch model whose step takes ~1 s on 2 cores (measured with the default rollout of 256 samples).
LARGE_MODEL = ["trainer.model.d_model=256", "trainer.model.n_layers=6", "trainer.model.n_heads=4",
               "trainer.model.vocab_size=512"]
# A megatron model whose heal moves ~78 MB (dp2_cp2_tp2_ep2) instead of ~5 MB.
WIDE_MEGATRON_MODEL = "wide_moe_5layer"
SECTIONS = ("compute_s", "reduce_s", "checksum_s", "witness_s", "event_write_s", "dump_s", "analyzer_s", "driver_rest_s")
# The baseline's ranks time the sections the two sides share, so each section's share of the gap shows.
BASELINE_SECTIONS = ("compute_s", "reduce_s", "witness_s", "dump_s")


class PeakMemory:
    """Samples the RSS of a process and all its descendants (from /proc) until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s = pid, interval_s
        self.total_mb = self.largest_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss_mb(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = [self._rss_mb(p) for p in process_tree(self.pid)]
            self.total_mb = max(self.total_mb, sum(rss))
            self.largest_mb = max(self.largest_mb, max(rss, default=0.0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def perf_rows(side_root: Path) -> list[dict]:
    """The committed rollouts' perf rows of a side, warm-up rollout 0 left out."""
    rows = [json.loads(ln) for p in sorted(side_root.glob("**/perf.jsonl")) for ln in p.read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r.get(key) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def step_sections(side_root: Path) -> list[dict]:
    """Every rank's sections of every attempt it trained, all phases (``step_sections.jsonl``)."""
    return [json.loads(ln) for p in sorted(side_root.glob("**/step_sections.jsonl")) for ln in p.read_text().splitlines()]


def committed_ranks(sections: list[dict], rollout_id: int) -> list[dict]:
    """A rollout's sections of every rank in its last attempt, the one that committed (none if never trained)."""
    ranks = [s for s in sections if s["step"] == rollout_id]
    return [s for s in ranks if s["attempt"] == max(r["attempt"] for r in ranks)]


def with_breakdown(side_root: Path, rows: list[dict]) -> list[dict]:
    """Each driver perf row plus its rollout's slowest rank per section (``step_sections.jsonl``)."""
    sections = step_sections(side_root)
    out = []
    for row in rows:
        committed = committed_ranks(sections, row["step"])
        if not committed:
            out.append(row)
            continue
        slowest = {k: max(s.get(k, 0.0) for s in committed) for k in (*SECTIONS, "total_s") if k not in row}
        slowest["driver_rest_s"] = row["step_time_s"] - row.get("analyzer_s", 0.0) - slowest.pop("total_s")
        out.append({**slowest, **row})
    return out


def cpu_per_step(side_root: Path, rows: list[dict]) -> float | None:
    """Median over the committed rollouts of the side's CPU seconds: its ranks' (every rank of the committed
    attempt, ``step_sections.jsonl``) plus the driver's (``perf.jsonl``, target only)."""
    timed = [s for s in step_sections(side_root) if "cpu_s" in s]
    per_step = []
    for row in rows:
        committed = committed_ranks(timed, row["step"])
        if committed:
            per_step.append(sum(s["cpu_s"] for s in committed) + row.get("cpu_s", 0.0))
    return statistics.median(per_step) if per_step else None


def training_s(sections: list[dict], rollout_id: int) -> float | None:
    """A rollout's own training: its committed attempt's slowest rank, from loading the rollout to the commit."""
    committed = committed_ranks(sections, rollout_id)
    return max(s["total_s"] for s in committed) if committed else None


class RunFailed(Exception):
    """A run that ended without a verdict (crashed, or refused its input): nothing of it can be timed."""


def last_line(text: str) -> str:
    """A process's last line of output, for a one-line reason."""
    return text.strip().splitlines()[-1] if text.strip() else ""


def verdict_of(report: dict) -> str:
    """``passed``, or ``failed:`` and the failed checks' names. A run whose verdict failed still trained every
    rollout, so its times stand; its row says so, and which checks failed."""
    return "passed" if report["passed"] else "failed: " + ", ".join(c["name"] for c in report["checks"] if not c["passed"])


def memory_backed_dir() -> str | None:
    """``/dev/shm`` where this host has a writable one, else None (the system's temporary directory).

    Run dirs go there: on a disk, the baseline's dumps were still being written back while the target (which
    trains after it) wrote its own, and the target's dumps took 2-3x as long. dp4 with the ~1 s/step model
    measured 1.18-1.35 on disk and 1.04-1.13 in memory, three runs each."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


RUN_ROOT = memory_backed_dir()


def ftexp_command(mode: str, scenario: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """The command line of one ``python -m ftexp`` invocation into ``run_dir``."""
    return [sys.executable, "-m", "ftexp", f"mode={mode}", f"scenario={scenario}", f"hydra.run.dir={run_dir}",
            *overrides]


@contextlib.contextmanager
def recorded_rollouts(mode: str, overrides: list[str]) -> Iterator[Path]:
    """The rollouts a configuration's no_failure runs train on, recorded once (``stage=prepare``) for all its
    repeats: they depend only on the configuration, and the ~1 s/step model's 16 took minutes to sample."""
    with tempfile.TemporaryDirectory(dir=RUN_ROOT) as tmp:
        run_dir = Path(tmp) / "run"
        done = subprocess.run(ftexp_command(mode, "no_failure", run_dir, [*overrides, "stage=prepare"]),
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RunFailed(f"stage=prepare: exit {done.returncode}: {last_line(done.stderr)}")
        yield run_dir / "rollout_data"


def run(mode: str, scenario: str, overrides: list[str], target_first: bool = False, rollouts: Path | None = None
        ) -> tuple[Path, PeakMemory, tempfile.TemporaryDirectory]:
    """One ``python -m ftexp`` run in a fresh run dir; ``target_first``: the target's side trains before the
    baseline's (``stage=target``, ``stage=baseline``, then ``stage=compare`` for the verdict) instead of after it;
    ``rollouts``: recorded rollouts to train on (the run checks them instead of sampling its own).
    The returned memory is the peak of whichever invocation peaked."""
    tmp = tempfile.TemporaryDirectory(dir=RUN_ROOT)
    run_dir = Path(tmp.name) / "run"
    if rollouts is not None and rollouts.is_dir():
        shutil.copytree(rollouts, run_dir / "rollout_data")
    stages = [["stage=target"], ["stage=baseline"], ["stage=compare", f"run_dir={run_dir}"]] if target_first else [[]]
    peak = None
    for stage in stages:
        proc = subprocess.Popen(ftexp_command(mode, scenario, run_dir, [*overrides, *stage]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        memory = PeakMemory(proc.pid)
        _, stderr = proc.communicate()
        memory.stop()
        peak = memory if peak is None or memory.total_mb > peak.total_mb else peak
        if proc.returncode != 0 and not (run_dir / "report.json").exists():
            tmp.cleanup()
            raise RunFailed(f"{' '.join(stage) or 'run'}: exit {proc.returncode}, no verdict: {last_line(stderr)}")
        if (run_dir / "report.json").exists():
            break  # a verdict: the run is over, whether every stage ran or a side's training failed
    return run_dir, peak, tmp


def run_taking_turns(mode: str, overrides: list[str], target_first: bool, rollouts: Path, turn_s: float
                     ) -> tuple[Path, PeakMemory, tempfile.TemporaryDirectory, dict[str, SideTurns]]:
    """One no_failure run whose sides train at once, taking turns at the machine ``turn_s`` seconds each
    (``taking_turns.py``; the target's first if ``target_first``), then ``stage=compare`` for the verdict.
    The returned memory is the peak of whichever side peaked."""
    tmp = tempfile.TemporaryDirectory(dir=RUN_ROOT)
    work = Path(tmp.name)
    run_dir = work / "run"
    shutil.copytree(rollouts, run_dir / "rollout_data")
    sides, memories = {}, []
    # The first turn's side also starts first: two runs of the same side measured 2-3 % apart by which started first.
    for side in ("target", "baseline") if target_first else ("baseline", "target"):
        # One run dir for both; each invocation's Hydra files go elsewhere, so that neither overwrites the other's.
        command = ftexp_command(mode, "no_failure", work / f"hydra-{side}", [*overrides, f"stage={side}", f"run_dir={run_dir}"])
        with open(work / f"{side}.err", "w") as err:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        sides[side] = (proc, run_dir / side / "perf.jsonl")
        memories.append(PeakMemory(proc.pid))
    turns = take_turns(sides, next(iter(sides)), turn_s)
    for memory in memories:
        memory.stop()
    try:
        for side, (proc, _) in sides.items():
            if proc.returncode != 0:
                raise RunFailed(f"stage={side}: exit {proc.returncode}: {last_line((work / f'{side}.err').read_text())}")
            if turns[side].writes_while_stopped():
                raise RunFailed(f"stage={side}: a process of it ran while its side was stopped")
        done = subprocess.run(ftexp_command(mode, "no_failure", work / "hydra-compare",
                                            [*overrides, "stage=compare", f"run_dir={run_dir}"]),
                              capture_output=True, text=True)
        if not (run_dir / "report.json").exists():
            raise RunFailed(f"stage=compare: exit {done.returncode}, no verdict: {last_line(done.stderr)}")
    except RunFailed:
        tmp.cleanup()
        raise
    return run_dir, max(memories, key=lambda m: m.total_mb), tmp, turns


def side_rows(side_root: Path, turns: SideTurns | None) -> tuple[list[dict], list[dict]]:
    """A side's perf rows, and the rows to break down into sections. Taking turns, a step's time counts only while
    its side ran (``stopped_s`` says how much was taken out), and only the steps that no turn interrupted are
    broken down: the ranks time the sections with clocks that ran on while their side was stopped."""
    rows = perf_rows(side_root)
    if turns is None:
        return rows, with_breakdown(side_root, rows)
    timed = []
    for row in rows:
        running_s, stopped_s = turns.running_time(row["step"], row["step_time_s"])
        timed.append({**row, "step_time_s": running_s, "stopped_s": stopped_s})
    return timed, with_breakdown(side_root, [r for r, t in zip(rows, timed) if t["stopped_s"] == 0.0])


def step_row(mode: str, label: str, overrides: list[str], target_first: bool = False,
             rollouts: Path | None = None, turn_s: float = 0.0) -> dict:
    """One no_failure run's row; ``turn_s`` > 0: its sides take turns at the machine (``run_taking_turns``)."""
    load = os.getloadavg()[0]
    if turn_s:
        run_dir, memory, tmp, turns = run_taking_turns(mode, overrides, target_first, rollouts, turn_s)
    else:
        (run_dir, memory, tmp), turns = run(mode, "no_failure", overrides, target_first, rollouts), {}
    with tmp:
        base, base_sections = side_rows(run_dir / "baseline", turns.get("baseline"))
        targ, targ_sections = side_rows(run_dir / "target", turns.get("target"))
        verdict = verdict_of(json.loads((run_dir / "report.json").read_text()))
        row = {"mode": mode, "run": label, "verdict": verdict, "first": "target" if target_first else "baseline",
               "turn_s": turn_s or None, "load_avg": load,
               "baseline_s": median_of(base, "step_time_s"),
               "target_s": median_of(targ, "step_time_s"), "peak_mb": round(memory.total_mb),
               "largest_process_mb": round(memory.largest_mb),
               "baseline_cpu_s": cpu_per_step(run_dir / "baseline", base),
               "target_cpu_s": cpu_per_step(run_dir / "target", targ)}
        row["ratio"] = row["target_s"] / row["baseline_s"]
        row["cpu_ratio"] = row["target_cpu_s"] / row["baseline_cpu_s"] if row["baseline_cpu_s"] else None
        if turns:
            row["steps_broken_down"] = f"{len(base_sections)} / {len(targ_sections)} of {len(base)} / {len(targ)}"
        row.update({k: median_of(targ_sections, k) for k in SECTIONS})
        row.update({f"baseline_{k}": median_of(base_sections, k) for k in BASELINE_SECTIONS})
        return row


def median_run(ranked: list[dict], runs: list[dict]) -> dict:
    """The middle of ``ranked`` (of an even number, the higher middle one) as a configuration's row, with every
    run's verdict (not only the middle one's), the number of runs, and every run for the JSON."""
    row = dict(ranked[len(ranked) // 2], repeats=len(runs))
    row["verdict"] = "; ".join(sorted({r["verdict"] for r in runs}))
    row["runs"] = runs
    return row


def repeated_step_row(mode: str, label: str, overrides: list[str], repeats: int, turn_s: float = 0.0) -> dict:
    """The median of ``repeats`` runs by wall ratio, with the range of the wall and CPU ratios over them. The runs
    alternate which side trains (or takes its turn) first, the baseline in the first run, so that what one side
    leaves behind on the machine does not always land on the same side."""
    with recorded_rollouts(mode, overrides) as rollouts:
        runs = [step_row(mode, label, overrides, i % 2 == 1, rollouts, turn_s) for i in range(repeats)]
    rows = sorted(runs, key=lambda r: r["ratio"])
    row = median_run(rows, runs)  # the runs in the order they ran: the host's drift shows
    row["ratio_range"] = f"{rows[0]['ratio']:.3f}–{rows[-1]['ratio']:.3f}"
    cpu = sorted(r["cpu_ratio"] for r in rows if r["cpu_ratio"] is not None)
    row["cpu_ratio_range"] = f"{cpu[0]:.3f}–{cpu[-1]:.3f}" if cpu else None
    # The least disturbed run of each side: the machine's noise only ever adds time.
    row["best_ratio"] = min(r["target_s"] for r in rows) / min(r["baseline_s"] for r in rows)
    return row


def summary_line(row: dict) -> str:
    """One row as ``key=value`` pairs, for the progress output (a repeated row's runs left out)."""
    return " ".join(f"{k}={fmt(v)}" for k, v in row.items() if k != "runs")


def heal_row(mode: str, spare_cells: int, model: str | None = None) -> dict:
    """One with_failure run's shrink and heal; ``model``: a megatron preset other than the mode's own."""
    overrides = [f"mode.model_preset={model}"] if model else []
    run_dir, _, tmp = run(mode, "with_failure", [*overrides, f"trainer.spare_cells={spare_cells}"])
    with tmp:
        report = json.loads((run_dir / "report.json").read_text())
        recoveries = [r for c in report["checks"] if c["name"].endswith("recovery") for r in c["details"]["recoveries"]]
        shrink = next((r for r in recoveries if r["kind"] == "shrink"), None)
        heal = next((r for r in recoveries if r["kind"] == "heal"), None)
        if shrink is None or heal is None:
            raise RunFailed(f"{verdict_of(report)}; the report holds no shrink and heal to time")
        # The way back spans two rollouts' training: the survivors' retry of the crashed one, and the healed
        # quorum's first. What is left of it is the recovery's own: detection, reconfigures, round trips.
        sections = step_sections(run_dir / "target")
        trained = [training_s(sections, r) for r in (shrink["rollout_id"], heal["rollout_id"])]
        way_back = heal.get("fault_to_commit_s")
        trained_s = None if way_back is None or None in trained else sum(trained)
        return {"mode": mode, "model": model or "mode's", "spare_cells": spare_cells, "verdict": verdict_of(report),
                "took_spare": heal.get("spare"),
                "detection_s": shrink.get("detection_s"), "shrink_first_commit_s": shrink["first_commit_s"],
                "allocate_s": heal.get("allocate_s"), "configure_s": heal.get("configure_s"),
                "transfer_wait_s": heal.get("transfer_wait_s"), "transfer_s": heal.get("transfer_s"),
                "load_s": heal.get("load_s"),
                "heal_first_commit_s": heal["first_commit_s"],
                "start_to_commit_s": heal.get("start_to_commit_s"), "fault_to_commit_s": way_back,
                "training_s": None if trained_s is None else round(trained_s, 3),
                "recovery_s": None if trained_s is None else round(way_back - trained_s, 3),
                "heal_bytes": heal["bytes"], "heal_bytes_per_s": heal.get("heal_bytes_per_s"),
                "connections": heal.get("connections"),
                "transfer_vs_loopback": (heal["heal_bytes_per_s"] / loopback_bytes_per_s(heal["bytes"])
                                         if heal.get("heal_bytes_per_s") else None),
                "transfer_vs_loopback_same_connections": (
                    heal["heal_bytes_per_s"] / loopback_bytes_per_s(heal["bytes"], connections=heal["connections"])
                    if heal.get("heal_bytes_per_s") else None)}


def repeated_heal_row(mode: str, spare_cells: int, model: str | None, repeats: int) -> dict:
    """The median of ``repeats`` with_failure runs by the transfer's rate over a raw copy, with that ratio's range
    over them. A heal of the mode's own megatron model moves its 5 MB in a few ms, and one such transfer is a
    draw from a wide spread (0.11-3.5 times a raw copy in single runs); the row is that median run as measured,
    its other timings included."""
    rows = [heal_row(mode, spare_cells, model) for _ in range(repeats)]
    rated = sorted((r for r in rows if r["transfer_vs_loopback"] is not None), key=lambda r: r["transfer_vs_loopback"])
    row = median_run(rated or rows, rows)
    if len(rated) > 1:
        row["transfer_vs_loopback_range"] = (f"{rated[0]['transfer_vs_loopback']:.3f}–"
                                             f"{rated[-1]['transfer_vs_loopback']:.3f}")
    return row


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def markdown_table(intro: str, rows: list[dict], cols: list[str]) -> list[str]:
    """A markdown section: ``intro``, then ``rows`` as a table of ``cols``."""
    return ["", intro, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols),
            *("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows)]


def engine_of(mode: str) -> str:
    """The engine a mode runs by default (the first it lists)."""
    return yaml.safe_load((MODES / f"{mode}.yaml").read_text())["engines"][0]


def _figure(figure: str, measured: float | None, limit: float, *, at_least: bool = False,
            spread: str | None = None) -> dict:
    """One figure against its bound: at most ``limit``, or at least it."""
    met = None if measured is None else (measured >= limit if at_least else measured <= limit)
    return {"figure": figure, "measured": measured, "spread": spread, "target": f"{'≥' if at_least else '≤'} {limit:g}",
            "met": {None: "-", True: "yes", False: "no"}[met]}


def _unless_passed(row: dict) -> str:
    """A figure's note when its run's verdict did not pass: measured all the same, but not a clean run."""
    return "" if row["verdict"] == "passed" else f" (verdict {row['verdict']})"


def target_rows(steps: list[dict], heals: list[dict]) -> list[dict]:
    """This run's rows as the figures fault tolerance is held to, each with its bound and whether it was met."""
    rows = []
    for step in steps:
        megatron = engine_of(step["mode"]) == "megatron"
        if step["run"] == "audit off":
            limit = 1.10 if megatron else 1.05
        elif step["run"] == "audit on" and not megatron:
            limit = 1.25
        elif step["run"] == "large, audit on":
            limit = 1.03
        else:
            continue  # no bound for megatron with its audits on
        rows.append(_figure(f"target ÷ baseline step, {step['run']}, {step['mode']}{_unless_passed(step)}",
                            step.get("ratio"), limit, spread=step.get("ratio_range")))
    for heal in heals:
        # A wide model's crash → commit spans its longer steps: only its transfer is held to a bound.
        wide = heal.get("model", "mode's") != "mode's"
        model = f" ({heal['model']})" if wide else ""
        if heal["spare_cells"] == 1 and not wide:
            limit = 5.0 if engine_of(heal["mode"]) == "megatron" else 2.0
            named = f"{heal['mode']}{_unless_passed(heal)}"
            # The plan trains a shrunk rollout before it restarts the cell, so the crash → the cell back spans
            # two rollouts; each half of that way back is held to the bound too.
            detection, shrunk = heal.get("detection_s"), heal.get("shrink_first_commit_s")
            rows.append(_figure(f"crash → next commit, the shrunk quorum's (s), {named}",
                                None if detection is None or shrunk is None else round(detection + shrunk, 3), limit))
            rows.append(_figure(f"restart → commit with the cell back (s), one spare, {named}",
                                heal.get("start_to_commit_s"), limit))
            # The whole way back is two rollouts' training plus the recovery; held to the bound is the recovery's
            # own time, and the whole way is shown beside it.
            whole = heal.get("fault_to_commit_s")
            rows.append(_figure(f"crash → commit with the cell back, less its two rollouts' training (s), one spare, "
                                f"{named}", heal.get("recovery_s"), limit,
                                spread=None if whole is None or heal.get("training_s") is None else
                                f"whole way {whole:.3f} s, of it training {heal['training_s']:.3f} s"))
        same = heal.get("transfer_vs_loopback_same_connections")
        spreads = [f"{heal['transfer_vs_loopback_range']} over {heal['repeats']} runs"] \
            if heal.get("transfer_vs_loopback_range") else []
        if same and heal["connections"] > 1:
            spreads.append(f"{same:.3f} on {heal['connections']} connections")
        rows.append(_figure(
            f"heal transfer ÷ raw loopback copy, {heal['mode']}{model}, spare_cells={heal['spare_cells']}"
            f"{_unless_passed(heal)}", heal.get("transfer_vs_loopback"), 0.5, at_least=True,
            spread="; ".join(spreads) or None))
    return rows


def markdown(steps: list[dict], heals: list[dict], when: str) -> str:
    cols = ["mode", "run", "verdict", "repeats", "turn_s", "load_avg", "baseline_s", "target_s", "ratio", "ratio_range",
            "best_ratio", "baseline_cpu_s", "target_cpu_s", "cpu_ratio", "cpu_ratio_range", *SECTIONS,
            *(f"baseline_{k}" for k in BASELINE_SECTIONS), "steps_broken_down", "peak_mb"]
    lines = [f"# ftexp step-time benchmark ({when}, one machine, one invocation, "
             f"run dirs in {RUN_ROOT or tempfile.gettempdir()})"]
    if steps:
        lines += markdown_table(
            "Seconds per committed rollout (median, rollout 0 skipped) of the median run of `repeats` (by wall ratio; "
            "`*_range`: the lowest and highest ratio over the repeats; `best_ratio`: the target's fastest run over "
            "the baseline's); the target's breakdown is the median over "
            "rollouts of the slowest cell's section times; `driver_rest_s` is the driver's step time minus its "
            "analyzer and its slowest cell's training of it (Ray round trips, refresh; a call trains a run of "
            "rollouts, and its first carries the round trip); `baseline_*_s`: the same sections of the "
            "baseline's slowest rank, where the two sides share them. `*_cpu_s`: the side's CPU "
            "seconds per committed rollout (median; ranks, plus the target's driver), which the machine's load "
            "(`load_avg`, 1-minute, at the run's start) moves much less than the wall times. `turn_s`: the two sides "
            "trained at once, taking turns at the machine this many seconds each, and a step's time counts only while "
            "its side ran; its sections are the medians over the steps no turn interrupted (`steps_broken_down`, "
            "baseline / target). Empty: the sides trained one after the other.", steps, cols)
    if heals:
        lines += markdown_table(
            "Crash → shrink → heal (`scenario=with_failure`), seconds. `detection_s`: the crash → the "
            "shrink; `allocate_s` … `heal_first_commit_s`: the heal's steps; `start_to_commit_s`: the cell's "
            "restart request → its first commit; `transfer_wait_s`: a rank's configured group → its peer ready for the "
            "bytes (the two processes' configure skew); `transfer_s`: the source's connection → the last byte "
            "received; `load_s`: the "
            "healed replica taking the received state in; `fault_to_commit_s`: the crash → the first commit with every "
            "cell back (this plan restarts the cell only after the shrunk rollout committed); `training_s`: the two "
            "rollouts' own training on that way (each its committed attempt's slowest rank, loading the rollout → "
            "the commit): the survivors' retry of the crashed rollout and the healed quorum's first; `recovery_s`: "
            "what is left of the way (detection, reconfigures, the driver's round trips, the heal); `transfer_vs_loopback`: "
            "the heal's bytes/s over a raw loopback socket copy of the same bytes; `…_same_connections`: over a raw copy "
            "of the same bytes split over the heal's `connections` (one per rank pair), all at once:", heals,
            [k for k in dict.fromkeys(k for heal in heals for k in heal) if k != "runs"])
    if steps or heals:
        lines += markdown_table(
            "The figures fault tolerance is held to, from the rows above (`spread`: a step ratio's range over the "
            "repeats, or a transfer's ratio range over its runs and its rate over a raw copy on as many connections "
            "as it used; the soak's flatness is "
            "`bench/long_run.py`'s):", target_rows(steps, heals), ["figure", "measured", "spread", "target", "met"])
    return "\n".join(lines) + "\n"


def measure(rows: list[dict], identity: dict, row_of: Callable[..., dict], *row_args) -> None:
    """Append ``row_of(*row_args)`` to ``rows``; a run without a verdict becomes a row saying so (``identity`` and
    the reason), and the bench goes on to the next configuration."""
    try:
        rows.append(row_of(*row_args))
    except RunFailed as e:
        rows.append({**identity, "verdict": f"none ({e})"})
    print(summary_line(rows[-1]), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["dp2", "dp4"])
    parser.add_argument("--rollouts", type=int, default=16,
                        help="rollouts per no_failure run of the ~1 s/step model and megatron modes (rollout 0 is warm-up)")
    parser.add_argument("--small-rollouts", type=int, default=128,
                        help="rollouts per no_failure run of the small torch models (a side trains ~8 s: several turns)")
    parser.add_argument("--repeats", type=int, default=3, help="no_failure runs per configuration (the median is reported)")
    parser.add_argument("--heal", action="store_true", help="also time a with_failure run per mode")
    parser.add_argument("--heal-repeats", type=int, default=3,
                        help="with_failure runs per heal configuration (the median by transfer rate is reported)")
    parser.add_argument("--heal-only", action="store_true",
                        help="only the with_failure runs (no step rows; latest.md, the step table, is left as it is)")
    parser.add_argument("--audit", choices=["on", "off", "both"], default="both",
                        help="which of a mode's no_failure runs to time: with the audit on, off, or both")
    parser.add_argument("--turn-s", type=float, default=5.0,
                        help="no_failure runs: their sides train at once, taking turns at the machine this many "
                             "seconds each (< the 10 s cross-cell timeout); 0: one after the other")
    parser.add_argument("--large", action="store_true",
                        help="also run a ~1 s/step torch model (torch modes); with --heal, heal a wide megatron model")
    parser.add_argument("--name", default=dt.datetime.now().strftime("%Y-%m-%d_%H%M"), help="results file name")
    args = parser.parse_args()
    if not 0 <= args.turn_s < 10:
        parser.error(f"--turn-s {args.turn_s:g}: must be 0 or more and below 10 (a stopped target's cross-cell "
                     f"collectives time out after 10 s)")
    steps, heals = [], []
    audits = [] if args.heal_only else ["on", "off"] if args.audit == "both" else [args.audit]
    for mode in args.modes:
        # Turns pay only where a side trains over several of them. A small torch model's side trained its 16
        # rollouts in about a second, within one turn: taking turns, whether the target trained right after its
        # own start-up or seconds later decided its ratio (dp2, audit on: 0.75-1.36 over nine runs), and one after
        # the other the host's moment did (dp4, audit off: 0.57-1.51 over seven). Over 128 rollouts, taking turns:
        # dp4 audit off 0.92-1.02 and 0.93-1.01 over five runs in two invocations.
        torch_engine = engine_of(mode) == "torch"  # its own models are the small ones
        rollouts = [f"scenario.num_rollout={args.small_rollouts if torch_engine else args.rollouts}"]
        for audit in audits:
            label, extra = f"audit {audit}", [] if audit == "on" else ["trainer.audit=false"]
            measure(steps, {"mode": mode, "run": label}, repeated_step_row, mode, label, rollouts + extra, args.repeats,
                    args.turn_s)
        if args.large and torch_engine and not args.heal_only:
            measure(steps, {"mode": mode, "run": "large, audit on"}, repeated_step_row, mode, "large, audit on",
                    [f"scenario.num_rollout={args.rollouts}", *LARGE_MODEL], args.repeats, args.turn_s)
        if args.heal or args.heal_only:
            for spare_cells in (0, 1):
                measure(heals, {"mode": mode, "spare_cells": spare_cells}, repeated_heal_row, mode, spare_cells, None,
                        args.heal_repeats)
            if args.large and engine_of(mode) == "megatron":
                measure(heals, {"mode": mode, "model": WIDE_MEGATRON_MODEL, "spare_cells": 1}, repeated_heal_row, mode,
                        1, WIDE_MEGATRON_MODEL, args.heal_repeats)
    table = markdown(steps, heals, args.name)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"steps": steps, "heals": heals}, indent=2))
    (RESULTS / f"{args.name}.md").write_text(table)
    if steps:
        (RESULTS / "latest.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
