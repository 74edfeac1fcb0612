"""Two real process trees taking turns at the machine: only one computes at a time, and its steps' times count
only while it ran."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))

import taking_turns  # noqa: E402
from taking_turns import take_turns  # noqa: E402

# A side: a parent that starts a worker (as a job starts its ranks) and waits for it. The worker sleeps through
# its start-up, then runs steps that each burn STEP_CPU_S of CPU, appending a perf line after each, with the step's
# time on a clock that runs on while the process is stopped (as the ranks' do).
SIDE = """
import json, subprocess, sys, time
if sys.argv[1] == "parent":
    sys.exit(subprocess.call([sys.executable, "-c", sys.argv[2], "worker", sys.argv[2], *sys.argv[3:]]))
perf, start_up_s, steps, step_cpu_s = sys.argv[3], float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
time.sleep(start_up_s)
for step in range(steps):
    started, cpu = time.monotonic(), time.process_time()
    while time.process_time() - cpu < step_cpu_s:
        pass
    with open(perf, "a") as f:
        f.write(json.dumps({"step": step, "step_time_s": time.monotonic() - started}) + "\\n")
"""
STEP_CPU_S, TURN_S = 0.15, 0.4


def _sides(tmp_path: Path) -> dict:
    sides = {}
    for name, start_up_s in (("slow_start", 0.3), ("quick_start", 0.0)):
        perf = tmp_path / f"{name}.jsonl"
        proc = subprocess.Popen([sys.executable, "-c", SIDE, "parent", SIDE, str(perf), str(start_up_s), "12",
                                 str(STEP_CPU_S)])
        sides[name] = (proc, perf)
    return sides


def test_one_side_computes_at_a_time_and_its_steps_count_only_while_it_ran(tmp_path):
    turns = take_turns(_sides(tmp_path), "slow_start", TURN_S)
    for name, side in turns.items():
        assert sorted(side.ends) == list(range(12)), name
        # The worker (a grandchild) was stopped with its parent: it never wrote while its side was stopped.
        assert side.writes_while_stopped() == 0, name
        rows = [json.loads(ln) for ln in side.perf.read_text().splitlines()][1:]
        timed = [side.running_time(r["step"], r["step_time_s"]) for r in rows]
        interrupted = [running for running, stopped in timed if stopped > 0]
        whole = [running for running, stopped in timed if stopped == 0]
        # Turns interrupted steps: their wall time holds the other side's turn.
        assert interrupted and whole and max(r["step_time_s"] for r in rows) > TURN_S
        # With the stops taken out, an interrupted step took about as long as a whole one, and no step less than
        # the CPU it burned. Each interrupted step spans a whole turn of the other side's: left in, it would add
        # ~TURN_S. The margin is additive because another test loading the machine slows a resumed step more
        # than a whole one (1.7x of a whole step's median, once, in CI).
        assert statistics.median(interrupted) < statistics.median(whole) + TURN_S / 2, (name, timed)
        assert min(running for running, _ in timed) > 0.9 * STEP_CPU_S, (name, timed)
    # The turns began once both had committed their first rollout: the quick starter waited for the slow one.
    assert min(side.ends[1] for side in turns.values()) > max(side.ends[0] for side in turns.values())
    assert turns["quick_start"].stopped[0][1] - turns["quick_start"].stopped[0][0] > 0.2
    # No side waited much longer than the other's turn (a target's cross-cell collectives would time out).
    assert max(b - a for side in turns.values() for a, b in side.stopped) < 2 * TURN_S


def test_a_process_left_running_while_its_side_is_stopped_is_caught(tmp_path, monkeypatch):
    # Planted: only a side's first process is stopped, so its worker keeps computing through the other's turns.
    monkeypatch.setattr(taking_turns, "process_tree", lambda pid: [pid])
    turns = take_turns(_sides(tmp_path), "slow_start", TURN_S)
    assert sum(side.writes_while_stopped() for side in turns.values()) > 0
