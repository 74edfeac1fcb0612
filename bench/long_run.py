"""Benchmark: does a long soak stay flat? Step time, driver memory and run-dir growth over hundreds of rollouts.

Runs ``python -m ftexp mode=dp2 scenario=ft_random scenario.num_steps=<N>`` (only the target trains,
random faults throughout) and, while it runs, samples every second the target job's driver process
(its RSS) and the size of the target's run dir, next to how many rollouts have committed so far
(``perf.jsonl``). A trainer whose per-rollout work grows with the history — re-reading the event
log, a buffer scanned whole, files rewritten — shows here as a rising step time, a rising RSS or
growing bytes per rollout. Reported, each as the late window over the early one (rollouts around
5 % and 95 % of the run, medians over a window of 10 rollouts so a heal's slow rollout does not
decide it):

* step time (rollout ~190 over rollout ~10 on 200 rollouts, held to <= 1.10);
* the driver's analyzer, part of the step time (the rules run before every rollout; a check whose
  cost follows the history shows here first);
* the driver's RSS;
* run-dir bytes added per rollout.

The JSON also keeps every rollout's step and analyzer time, to see the curve between the windows.

    python bench/long_run.py                         # dp2, 200 rollouts
    python bench/long_run.py --rollouts 60 -- trainer.audit=false
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
WINDOW = 10


class Sampler:
    """Every ``interval_s``: (committed rollouts, target driver RSS in MB, target dir bytes)."""

    def __init__(self, target_dir: Path, interval_s: float = 1.0):
        self.target_dir, self.interval_s = target_dir, interval_s
        self.samples: list[tuple[int, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _driver_pid(self) -> int | None:
        """The target job's process (submitit's ``_submit`` on the target's submitit dir), not its controller."""
        marker = str(self.target_dir / "submitit").encode()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                    if marker in cmdline and b"submitit.core._submit" in cmdline:
                        return int(entry.name)
                except OSError:
                    continue
        return None

    def _committed(self) -> int:
        perf = self.target_dir / "perf.jsonl"
        return len(perf.read_text().splitlines()) if perf.exists() else 0

    def _bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.target_dir):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except OSError:
                    pass
        return total

    def _run(self) -> None:
        pid = None
        while not self._stop.wait(self.interval_s):
            pid = pid or self._driver_pid()
            if pid is None:
                continue
            try:
                rss_kb = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if ln.startswith("VmRSS:"))
            except (OSError, StopIteration):
                continue
            self.samples.append((self._committed(), rss_kb / 1024, self._bytes()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def window_median(values_by_rollout: dict[int, float], around: int) -> float | None:
    values = [v for k, v in values_by_rollout.items() if around - WINDOW // 2 <= k < around + WINDOW // 2]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="dp2")
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--name", default=dt.date.today().isoformat() + "-long-run")
    parser.add_argument("overrides", nargs="*", help="more ftexp overrides (after --)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        sampler = Sampler(run_dir / "target")
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "ftexp", f"mode={args.mode}", "scenario=ft_random",
                               f"scenario.num_steps={args.rollouts}", f"hydra.run.dir={run_dir}", *args.overrides],
                              capture_output=True, text=True)
        sampler.stop()
        if proc.returncode != 0:
            raise SystemExit(f"the soak failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        perf = [json.loads(ln) for ln in (run_dir / "target" / "perf.jsonl").read_text().splitlines()]
        steps = {r["step"]: r["step_time_s"] for r in perf}
        analyzer = {r["step"]: r["analyzer_s"] for r in perf if "analyzer_s" in r}
        report = json.loads((run_dir / "report.json").read_text())
        injections = next((len(c["details"].get("recoveries", [])) for c in report["checks"] if c["name"] == "injections"), None)

    early, late = max(WINDOW // 2, args.rollouts // 20), args.rollouts - max(WINDOW // 2, args.rollouts // 20)
    # The last sample taken at each committed-rollout count.
    rss = {committed: mb for committed, mb, _ in sampler.samples}
    size = {committed: size for committed, _, size in sampler.samples}
    growth = {k: size[k] - size[k - 1] for k in size if k - 1 in size}
    rows = []
    for figure, series in (("step_time_s", steps), ("analyzer_s", analyzer), ("driver_rss_mb", rss),
                           ("run_dir_bytes_per_rollout", growth)):
        a, b = window_median(series, early), window_median(series, late)
        rows.append({"figure": figure, "early": a, "late": b, "ratio": (b / a) if a and b is not None else None})
    result = {"mode": args.mode, "rollouts": args.rollouts, "early_rollout": early, "late_rollout": late,
              "wall_s": round(time.monotonic() - started, 1), "injections": injections, "overrides": args.overrides,
              "load_average": os.getloadavg(), "rows": rows,
              "by_rollout": {"step_time_s": steps, "analyzer_s": analyzer}}

    lines = [f"# ftexp long-run benchmark ({args.name})", "",
             f"`mode={args.mode} scenario=ft_random scenario.num_steps={args.rollouts}` {' '.join(args.overrides)}: "
             f"{result['wall_s']} s wall, {injections} injections; medians of {WINDOW} rollouts around rollout {early} "
             f"(early) and {late} (late); load average at the end {result['load_average'][0]:.1f}.", "",
             "| figure | early | late | late ÷ early |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['figure']} | {_fmt(r['early'])} | {_fmt(r['late'])} | {_fmt(r['ratio'])} |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
