"""Both sides of a comparison on the machine at once, taking turns at it: step times the host's drift cancels out of.

Trained one after the other, the two sides of a run see two different machines: on a shared VM the same step's
time drifts by 10-20 % within minutes, often for a whole run at a time, far more than a 3 % bound's margin. Here
both sides' processes start together, and every ``turn_s`` seconds one side's every process (its job, Ray's
daemons and actors, its fork servers and ranks) is stopped (SIGSTOP) and the other's continued (SIGCONT). Only one
side computes at a time, with the machine to itself, and each sees the host as it was seconds before the other.
Their start-ups are not timed and run at once; the turns begin once both have committed their warm-up rollout (or
one has waited a turn for the other's), so that the rollouts timed interleave.

A side's clocks run on while it is stopped, so its step times are corrected here: a step's perf line is appended
when the step ends (the file's modification time says when), so its wall interval is known, and the part of it the
side spent stopped is taken out. The time to stop or continue a side's processes one by one counts against that
side. A line that a side wrote while it was stopped would mean a process of it was missed; ``take_turns`` reports
how many there were.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (from /proc)."""
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


def signal_tree(pid: int, sig: signal.Signals) -> set[int]:
    """Send ``sig`` to every process of ``pid``'s tree; twice over, since a process that was starting a child
    when it was stopped may have started it. Returns the pids signalled."""
    signalled = set()
    for _ in range(2):
        for p in process_tree(pid):
            if _signal(p, sig):
                signalled.add(p)
    return signalled


def _signal(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _version(path: Path) -> tuple[int, int]:
    """A file's modification time (ns) and size: the size too, since two appends within one tick of the file
    clock share a time."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@dataclass
class SideTurns:
    """What ``take_turns`` saw of one side."""

    perf: Path
    stopped: list[tuple[float, float]] = field(default_factory=list)  # wall-clock intervals the side was stopped
    ends: dict[int, float] = field(default_factory=dict)  # a perf line's rollout -> when its step ended (wall clock)
    writes: list[float] = field(default_factory=list)  # when the file was written, as each read found new lines
    lines_seen: int = 0
    last_read: tuple[int, int] = (0, 0)  # the file's (time, size) at the last read: unchanged, a poll reads nothing

    def stopped_within(self, start: float, end: float) -> float:
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.stopped)

    def read_new_lines(self) -> None:
        """The file's new lines end when it was last written; a line written with others in one go (the target
        trains runs of rollouts in one call) ended that much earlier as the later lines took."""
        try:
            seen = _version(self.perf)
            if seen == self.last_read:
                return  # the poll runs on the cores the sides are timed on: most find nothing new, cheaply
            while True:  # a line appended between reading the time and the text would get an earlier line's time
                lines = self.perf.read_text().splitlines()
                if (again := _version(self.perf)) == seen:
                    break
                seen = again
        except FileNotFoundError:
            return
        rows = [json.loads(ln) for ln in lines[self.lines_seen:] if ln.endswith("}")]
        written = seen[0] / 1e9
        if rows:
            self.writes.append(written)
            self.last_read = seen  # a half-written last line is read again at the next poll
        end = written
        for row in reversed(rows):
            self.ends[row["step"]] = end
            end -= row["step_time_s"]
        self.lines_seen += len(rows)

    def running_time(self, rollout: int, step_time_s: float) -> tuple[float, float]:
        """A step's time with the side running, and the part of its wall time it spent stopped."""
        end = self.ends[rollout]
        stopped = self.stopped_within(end - step_time_s, end)
        return step_time_s - stopped, stopped

    def writes_while_stopped(self) -> int:
        """How often the file was written while the side was stopped (a margin for the file clock's coarser ticks)."""
        return sum(1 for t in self.writes if any(a + 0.01 < t < b - 0.01 for a, b in self.stopped))


def take_turns(sides: dict[str, tuple[subprocess.Popen, Path]], first: str, turn_s: float,
               poll_s: float = 0.01) -> dict[str, SideTurns]:
    """Start-up, untimed, with every side at once; a side that has committed its warm-up rollout (its first perf
    line) waits, stopped, for the others', one turn at most. Then the sides take turns at the machine, ``turn_s``
    seconds each, ``first`` first, until every one has exited; once one has, the others run on without turns.
    ``sides``: name -> (process, its perf.jsonl). No side is stopped for much longer than the others' turns: a
    target's cross-cell collective in flight when it was stopped times out 10 s after it began."""
    turns = {name: SideTurns(perf) for name, (_, perf) in sides.items()}
    procs = {name: proc for name, (proc, _) in sides.items()}
    stopped_since: dict[str, float] = {}
    # The processes each stop reached, continued by pid as well as by tree: one whose parent exited just after the
    # stop (a side's last process ending) has left the tree, and would stay stopped for good.
    stopped_pids: dict[str, set[int]] = {}

    def alive() -> list[str]:
        return [name for name, proc in procs.items() if proc.poll() is None]

    def stop(name: str) -> None:
        stopped_pids[name] = signal_tree(procs[name].pid, signal.SIGSTOP)
        stopped_since[name] = time.time()

    def go_on(name: str) -> None:
        continued = time.time()
        signal_tree(procs[name].pid, signal.SIGCONT)
        for pid in stopped_pids.pop(name):
            _signal(pid, signal.SIGCONT)
        turns[name].stopped.append((stopped_since.pop(name), continued))

    try:
        while ((live := alive()) and not all(turns[name].lines_seen for name in live)
               and all(time.time() - since < turn_s for since in stopped_since.values())):
            for name in live:
                turns[name].read_new_lines()
                if turns[name].lines_seen and name not in stopped_since:
                    stop(name)
            time.sleep(poll_s)
        for name in alive():
            if name not in stopped_since:
                stop(name)
        running, turn_ends = None, 0.0
        while live := alive():
            for side in turns.values():
                side.read_new_lines()
            if running not in live or (len(live) > 1 and time.monotonic() >= turn_ends):
                following = (live[(live.index(running) + 1) % len(live)] if running in live
                             else first if first in live else live[0])
                if running in live:
                    stop(running)
                go_on(following)
                running, turn_ends = following, time.monotonic() + turn_s
            time.sleep(poll_s)
        for side in turns.values():
            side.read_new_lines()
        return turns
    finally:  # no process is left stopped: of a side that ended stopped, or of any when interrupted
        for name in stopped_since:
            signal_tree(procs[name].pid, signal.SIGCONT)
        for pids in stopped_pids.values():
            for pid in pids:
                _signal(pid, signal.SIGCONT)
