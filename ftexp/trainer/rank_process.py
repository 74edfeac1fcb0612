"""A rank's process: the rank's state and step live in a plain process beside its Ray actor.

Why a second process: a Ray actor with concurrency groups runs its methods on a pool thread, while
its main thread wakes every 10 ms to check for signals and takes the GIL each time. A training step
on that pool thread is preempted more and runs measurably slower than the same step in a plain
process. So the actor (``ftexp.trainer.cell_rank``, one for a cell's ranks on a node) is only the
ranks' address and supervisor: it has one such process per rank forked by its node's fork server
(``ftexp.forkserver``, with torch and the trainer already imported), forwards each call to its
rank's, and the processes that train have no Ray inside.

Three pipes, each a request/answer channel served by one thread of the rank's process:

- ``calls``: init, reconfigure, train, update_weights, save — one at a time, each answered with its
  result or its exception; served by the process's main thread;
- ``control``: ping, heartbeat, release_collectives — answered by the process's control thread, so
  a frozen process answers nothing (liveness stays "the RPC returned"), while a training call does
  not hold them up;
- ``faults``: the fault to inject, run by the control thread in the process that trains (no answer).

The actor and its ranks' processes die together. A rank's process gets SIGKILL from the fork server
when its actor dies (the actor's end of their connection closes; SIGKILL works even on a frozen
process), and from the kernel when the server dies. The actor's keeper thread for each rank waits for
that rank's process and, once it has ended, ends the actor too (SIGKILL, or the same exit code), and
with it the other ranks' processes: Ray then reports the death of the actor's ranks, and lifelines,
the death watch and the control plane see a dead cell as they would see it with an actor per rank.
An actor's call whose answer the death cut off waits for that end instead of raising.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Pipe
from typing import Any

from ftexp.forkserver import ASKER_PID_ENV, ask, end_with, fork_child

RANK_TARGET = "ftexp.trainer.rank:serve"  # what the fork server runs in a rank's process
RANK_PRELOAD = ("ftexp.trainer.rank", "torch._dynamo")  # a torch optimizer imports torch's compiler when it is
# built (~2.4 CPU-seconds): a fork server for ranks imports it once
RANKS_IN_ACTOR_ENV = "FTEXP_RANKS_IN_ACTOR"  # how many rank processes the rank's actor hosts
WHERE = "the rank's process"  # where a call ran, in the note an error carries back


def rank_cpu_seconds() -> float:
    """CPU seconds of the rank so far: this process's and its share of its actor's (split evenly among the ranks
    it hosts), which the rank costs too."""
    with open(f"/proc/{os.environ[ASKER_PID_ENV]}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # the stat file's 14th and 15th fields, in clock ticks
    actor_share = (utime + stime) / os.sysconf("SC_CLK_TCK") / int(os.environ.get(RANKS_IN_ACTOR_ENV, "1"))
    return time.process_time() + actor_share


# ---- the actor's side ----------------------------------------------------------------------------


class RankProcess:
    """The actor's side: has the rank's process forked, forwards calls to it, and ends the actor when it ends.
    ``ranks_in_actor``: how many rank processes the actor hosts, this one included."""

    def __init__(self, ranks_in_actor: int):
        ends = [Pipe() for _ in range(3)]
        self.calls, self.control, self.faults = (mine for mine, _ in ends)
        self._control_lock = threading.Lock()
        theirs = [t for _, t in ends]
        self.child = fork_child(RANK_TARGET, [t.fileno() for t in theirs],
                                dict(os.environ, **{RANKS_IN_ACTOR_ENV: str(ranks_in_actor)}))
        for t in theirs:
            t.close()
        end_with(self.child, "the rank's process")

    def build(self, *build_args: Any) -> None:
        """The first call: the rank builds (``ftexp.trainer.rank.Rank``'s arguments)."""
        self.call("__build__", *build_args)

    def call(self, method: str, *args: Any) -> Any:
        """A training-side call (one at a time): its result, or its exception raised here."""
        return ask(self.calls, (method, args))

    def ask_control(self, method: str, *args: Any) -> Any:
        """A control call, answered by the rank process's control thread even while a call trains."""
        with self._control_lock:
            return ask(self.control, (method, args))

    def inject_fault(self, mode: str) -> None:
        self.faults.send(mode)
