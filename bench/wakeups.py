"""Benchmark: what wakes on the cores while a side's ranks train, and how often a rank is taken off its core.

A thread that sleeps and is woken counts a voluntary context switch; a thread taken off its core because
another became runnable counts an involuntary one (``/proc/<pid>/task/<tid>/status``). On a machine whose
cores the ranks keep busy, every wake-up of another process takes a core from a rank for a moment, and the
rank comes back to colder caches: the same step then costs more CPU. This bench trains one side at a time
(``stage=baseline``, ``stage=target``) on rollouts recorded once, and over a window mid-run reads every
thread's switches: wake-ups per second by kind of process, and each rank's involuntary switches per second,
with the side's median step.

Usage:
    python bench/wakeups.py                    # dp2, both sides, 16 rollouts
    python bench/wakeups.py --large            # the ~1 s/step model (step_time.py's --large)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from step_time import LARGE_MODEL, RUN_ROOT, ftexp_command, last_line, markdown_table, recorded_rollouts


def _status(task: Path) -> tuple[int, int]:
    fields = dict(ln.split(":\t", 1) for ln in (task / "status").read_text().splitlines() if ":\t" in ln)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            out[int(entry.name)] = (int(stat[stat.rindex(")") + 2:].split()[1]), cmd or name)
    return out


def _switches() -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, tid) -> (voluntary, involuntary) switches of every thread."""
    out = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                for task in (proc / "task").iterdir():
                    out[(int(proc.name), int(task.name))] = _status(task)
            except (OSError, KeyError, ValueError):
                continue
    return out


def _kind(pid: int, processes: dict[int, tuple[int, str]]) -> str:
    parent, cmd = processes[pid]
    if "forkserver" in processes.get(parent, (0, ""))[1] and "forkserver" in cmd:
        # forked from its side's fork server (the target's, or the baseline's multiprocessing one); with live
        # rollout engines, which fork from the target's too, those would count here: run it on recorded rollouts
        return "rank"
    for marker, kind in (("ray::DashboardAgent", "Ray agents"), ("ray::RuntimeEnvAgent", "Ray agents"),
                         ("ray::", "Ray actors"), ("raylet", "Ray raylet"), ("gcs_server", "Ray GCS"),
                         ("log_monitor", "Ray log monitor"), ("dashboard", "Ray dashboard"),
                         ("autoscaler", "Ray autoscaler monitor"), ("submitit", "the side's job (driver)"),
                         ("forkserver", "fork server")):
        if marker in cmd:
            return kind
    return "everything else"


def side_row(mode: str, side: str, overrides: list[str], rollouts: Path, window_s: float) -> dict:
    with tempfile.TemporaryDirectory(dir=RUN_ROOT) as tmp:
        run_dir = Path(tmp) / "run"
        shutil.copytree(rollouts, run_dir / "rollout_data")
        # Its output goes to a file: a pipe nobody reads until the window is over would stall the run once full.
        with open(Path(tmp) / "stderr", "w") as err:
            proc = subprocess.Popen(ftexp_command(mode, "no_failure", run_dir, [*overrides, f"stage={side}"]),
                                    stdout=subprocess.DEVNULL, stderr=err)
        perf = run_dir / side / "perf.jsonl"
        while proc.poll() is None and (not perf.exists() or len(perf.read_text().splitlines()) < 3):
            time.sleep(0.2)  # mid-run: two rollouts committed
        before, t0 = _switches(), time.monotonic()
        time.sleep(window_s)
        after, elapsed = _switches(), time.monotonic() - t0
        processes = _processes()
        if proc.poll() is not None:
            raise SystemExit(f"{side}: the run ended before the {window_s:g} s window did: give it more rollouts")
        if proc.wait() != 0:
            raise SystemExit(f"{side}: exit {proc.returncode}: {last_line((Path(tmp) / 'stderr').read_text())}")
        steps = sorted(json.loads(ln)["step_time_s"] for ln in perf.read_text().splitlines()[1:])
    wakeups: dict[str, float] = {}
    rank_preemptions = []
    for (pid, tid), (vol, invol) in after.items():
        if (pid, tid) not in before or pid not in processes:
            continue
        kind = _kind(pid, processes)
        wakeups[kind] = wakeups.get(kind, 0.0) + (vol - before[(pid, tid)][0]) / elapsed
        if kind == "rank" and pid == tid:  # a rank's training thread
            rank_preemptions.append((invol - before[(pid, tid)][1]) / elapsed)
    row = {"side": side, "median_step_s": statistics.median(steps), "wakeups_per_s": sum(wakeups.values()),
           "rank_preemptions_per_s": " / ".join(f"{p:.0f}" for p in sorted(rank_preemptions))}
    row.update({kind: round(n) for kind, n in sorted(wakeups.items(), key=lambda kv: -kv[1])})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="dp2")
    parser.add_argument("--sides", nargs="+", default=["baseline", "target"])
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--large", action="store_true", help="the ~1 s/step torch model")
    parser.add_argument("--window-s", type=float, default=5.0)
    args = parser.parse_args()
    overrides = [f"scenario.num_rollout={args.rollouts}", *(LARGE_MODEL if args.large else [])]
    with recorded_rollouts(args.mode, overrides) as rollouts:
        rows = [side_row(args.mode, side, overrides, rollouts, args.window_s) for side in args.sides]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    print("\n".join(markdown_table(
        f"`{args.mode}`{' with the ~1 s/step model' if args.large else ''}: wake-ups per second mid-run by kind of "
        f"process (voluntary switches, every thread), each rank's training thread taken off its core per second "
        f"(involuntary switches), the side's median step:", rows, columns)))


if __name__ == "__main__":
    main()
