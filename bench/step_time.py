"""Benchmark: FT target step time ÷ plain-DP baseline step time, heal costs, peak memory.

Runs ``python -m ftexp mode=<mode> scenario=<scenario> scenario.num_rollout=<n>`` for each mode and
prints, per mode, the median wall time of a committed rollout on each side (rollout 0 is warm-up
and skipped), their ratio, the peak resident memory of the whole run (all processes: CLI, jobs,
ranks, Ray) and of its largest process, and — for scenarios that heal — recovery seconds and heal
bytes/s.

    python bench/step_time.py                       # dp2 and dp4, no_failure, 8 rollouts
    python bench/step_time.py --modes dp2 --scenario with_failure
    python bench/step_time.py --modes dp2_cp2_tp2_ep2 dp2_cp2_pp2 dp4_cp2 --rollouts 4   # megatron cells
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


class PeakMemory:
    """Samples the RSS of a process and all its descendants (from /proc) until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s = pid, interval_s
        self.total_mb = self.largest_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in Path(f"/proc/{p}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

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
            rss = [self._rss_mb(p) for p in self._tree(self.pid)]
            self.total_mb = max(self.total_mb, sum(rss))
            self.largest_mb = max(self.largest_mb, max(rss, default=0.0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def median_step(side_root: Path) -> float:
    times = [json.loads(ln) for p in sorted(side_root.glob("**/perf.jsonl")) for ln in p.read_text().splitlines()]
    return statistics.median(t["step_time_s"] for t in times if t["step"] > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["dp2", "dp4"])
    parser.add_argument("--scenario", default="no_failure")
    parser.add_argument("--rollouts", type=int, default=8, help="num_rollout for single-phase scenarios")
    args = parser.parse_args()
    print(f"{'mode':16} {'baseline s/step':>16} {'target s/step':>14} {'target/baseline':>16} "
          f"{'peak MB (all)':>14} {'(largest)':>10}  recoveries")
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            overrides = [f"mode={mode}", f"scenario={args.scenario}", f"hydra.run.dir={run_dir}"]
            if args.scenario == "no_failure":
                overrides.append(f"scenario.num_rollout={args.rollouts}")
            proc = subprocess.Popen([sys.executable, "-m", "ftexp", *overrides], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            memory = PeakMemory(proc.pid)
            _, stderr = proc.communicate()
            memory.stop()
            if proc.returncode != 0:
                print(f"{mode}: run failed (exit {proc.returncode})\n{stderr[-2000:]}")
                return 1
            base, targ = median_step(run_dir / "baseline"), median_step(run_dir / "target")
            report = json.loads((run_dir / "report.json").read_text())
            recoveries = [r for c in report["checks"] if c["name"].endswith("recovery")
                          for r in c["details"]["recoveries"]]
            rec = "; ".join(", ".join(f"{k}={v}" for k, v in r.items() if k.endswith("_s") or k.endswith("per_s"))
                            for r in recoveries) or "-"
            print(f"{mode:16} {base:16.4f} {targ:14.4f} {targ / base:16.2f} {memory.total_mb:14.0f} "
                  f"{memory.largest_mb:10.0f}  {rec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
