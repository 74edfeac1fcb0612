"""Benchmark: the CPU a Ray session spends on its own while nothing runs.

The target trains under a private Ray session; the baseline has none. Even idle, every process of the
session wakes on timers: the GCS, the raylet, the log monitor that forwards actors' output to the
driver, the driver, and each actor, whose main thread checks for signals every 10 ms (fixed in Ray).
That CPU comes out of the ranks' cores. This bench starts the session as the target does, with idle
actors shaped like a cell's rank, and prints each process's CPU over a window in percent of one core,
and the total as a share of the machine's cores: a floor under the target's step ratio on a machine
the ranks keep busy.

Usage:
    python bench/ray_idle.py                 # 2 actors (dp2's ranks), 20 s window
    python bench/ray_idle.py --actors 8      # dp2_cp2_tp2_ep2's ranks
"""

from __future__ import annotations

import argparse
import os
import time

import ftexp  # noqa: F401  before Ray: it sets the environment that keeps Ray's sockets on loopback
import ray
import psutil  # noqa: E402  (Ray ships psutil and puts it on sys.path)

from ftexp.trainer.local_ray import start_local_ray
from ray_call_cost import Rank  # shaped like a cell's rank; here it only waits
from step_time import markdown_table


def _role(process: psutil.Process, actor_pids: set[int]) -> str:
    if process.pid == os.getpid():
        return "driver"
    if process.pid in actor_pids:
        return "actor"
    command = " ".join(process.cmdline())
    for role in ("gcs_server", "raylet", "log_monitor", "monitor.py", "dashboard"):
        if role in command:
            return role.removesuffix(".py")
    return process.name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=20.0)
    args = parser.parse_args()

    start_local_ray(num_cpus=max(2, args.actors))
    actors = [Rank.remote() for _ in range(args.actors)]
    actor_pids = set(ray.get([a.__ray_call__.remote(lambda _: os.getpid()) for a in actors]))
    time.sleep(5)  # start-up settles
    session = [psutil.Process(), *psutil.Process().children(recursive=True)]
    session += [psutil.Process(pid) for pid in actor_pids if pid not in {p.pid for p in session}]
    before = {p.pid: sum(p.cpu_times()[:2]) for p in session}
    time.sleep(args.window_s)
    by_role: dict[str, list[float]] = {}
    for p in session:
        try:
            used = sum(p.cpu_times()[:2]) - before[p.pid]
        except psutil.Error:
            continue
        by_role.setdefault(_role(p, actor_pids), []).append(100 * used / args.window_s)
    ray.shutdown()

    rows = [{"process": role, "count": len(pcts), "core_pct_each": sum(pcts) / len(pcts), "core_pct": sum(pcts)}
            for role, pcts in sorted(by_role.items(), key=lambda kv: -sum(kv[1]))]
    total = sum(r["core_pct"] for r in rows)
    cores = os.cpu_count() or 1
    rows.append({"process": "total", "count": sum(r["count"] for r in rows), "core_pct": total})
    print(f"# An idle Ray session with {args.actors} rank-shaped actors, over {args.window_s:g} s")
    print("\n".join(markdown_table("CPU in percent of one core.", rows,
                                   ["process", "count", "core_pct_each", "core_pct"])))
    print(f"\n{total:.2f} % of one core is {total / cores:.2f} % of this machine's {cores} cores.")


if __name__ == "__main__":
    main()
