"""Benchmark: FT target step time ÷ plain-DP baseline step time, and heal costs.

Runs ``python -m ftexp mode=<mode> scenario=<scenario> scenario.num_rollout=<n>`` for each mode and
prints, per mode, the median wall time of a committed rollout on each side (rollout 0 is warm-up
and skipped), their ratio, and — for scenarios that heal — recovery seconds and heal bytes/s.

    python bench/step_time.py                       # dp2 and dp4, no_failure, 8 rollouts
    python bench/step_time.py --modes dp2 --scenario with_failure
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def median_step(side_root: Path) -> float:
    times = [json.loads(ln) for p in sorted(side_root.glob("**/perf.jsonl")) for ln in p.read_text().splitlines()]
    return statistics.median(t["step_time_s"] for t in times if t["step"] > 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["dp2", "dp4"])
    parser.add_argument("--scenario", default="no_failure")
    parser.add_argument("--rollouts", type=int, default=8, help="num_rollout for single-phase scenarios")
    args = parser.parse_args()
    print(f"{'mode':6} {'baseline s/step':>16} {'target s/step':>14} {'target/baseline':>16}  recoveries")
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            overrides = [f"mode={mode}", f"scenario={args.scenario}", f"hydra.run.dir={run_dir}"]
            if args.scenario == "no_failure":
                overrides.append(f"scenario.num_rollout={args.rollouts}")
            result = subprocess.run([sys.executable, "-m", "ftexp", *overrides], capture_output=True, text=True)
            if result.returncode != 0:
                print(f"{mode}: run failed (exit {result.returncode})\n{result.stderr[-2000:]}")
                return 1
            base, targ = median_step(run_dir / "baseline"), median_step(run_dir / "target")
            report = json.loads((run_dir / "report.json").read_text())
            recoveries = [r for c in report["checks"] if c["name"].endswith("recovery")
                          for r in c["details"]["recoveries"]]
            rec = "; ".join(", ".join(f"{k}={v}" for k, v in r.items() if k.endswith("_s") or k.endswith("per_s"))
                            for r in recoveries) or "-"
            print(f"{mode:6} {base:16.4f} {targ:14.4f} {targ / base:16.2f}  {rec}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
