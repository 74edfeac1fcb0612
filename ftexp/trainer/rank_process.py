"""A rank's process: the rank's state and step live in a plain process beside the node's rank host.

Why a second process: a Ray actor with concurrency groups runs its methods on a pool thread, while
its main thread wakes every 10 ms to check for signals and takes the GIL each time. A training step
on that pool thread is preempted more and runs measurably slower than the same step in a plain
process. So the actor (``ftexp.trainer.cell_rank``, one per node, hosting every rank placed there) is
only the ranks' address and supervisor: it has one such process per rank forked by its node's fork
server (``ftexp.forkserver``, with torch and the trainer already imported), forwards each call to its
rank's, and the processes that train have no Ray inside.

Three pipes, each a request/answer channel served by one thread of the rank's process:

- ``calls``: init, reconfigure, train, update_weights, save — one at a time, each answered with its
  result or its exception; served by the process's main thread;
- ``control``: ping, heartbeat, release_collectives — answered by the process's control thread, so
  a frozen process answers nothing (liveness stays "the RPC returned"), while a training call does
  not hold them up;
- ``faults``: the fault to inject, run by the control thread in the process that trains (no answer).

A rank's process ends when it fails, when the host kills it (the fork server SIGKILLs it, which works
even on a frozen process), or with its host (the fork server SIGKILLs it when the host's end of their
connection closes; the kernel, when the server dies). The host learns of the end from the fork server:
``on_end`` is called with how it ended, and a call that the end cut off, or any call after it, raises
``RankProcessEnded``.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Pipe
from typing import Any, Callable

from ftexp.forkserver import ASKER_PID_ENV, ask, describe_exit, fork_child, watch

RANK_TARGET = "ftexp.trainer.rank:serve"  # what the fork server runs in a rank's process
RANK_PRELOAD = ("ftexp.trainer.rank", "torch._dynamo")  # a torch optimizer imports torch's compiler when it is
# built (~2.4 CPU-seconds): a fork server for ranks imports it once
RANKS_SHARING_HOST_ENV = "FTEXP_RANKS_SHARING_HOST"  # how many ranks' processes the rank's host serves
WHERE = "the rank's process"  # where a call ran, in the note an error carries back
ENDED_REPORT_WAIT_S = 5.0  # the fork server reports a process's end right after its pipes close
CONTROL_WAIT_S = 5.0  # a healthy process answers a control call in milliseconds


class RankProcessEnded(Exception):
    """A call reached a rank whose process has ended (it failed, or was killed with its team)."""


def rank_cpu_seconds() -> float:
    """CPU seconds of the rank so far: this process's and its share of its host's (split evenly among the ranks
    that share it), which the rank costs too."""
    with open(f"/proc/{os.environ[ASKER_PID_ENV]}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # the stat file's 14th and 15th fields, in clock ticks
    host_share = (utime + stime) / os.sysconf("SC_CLK_TCK") / int(os.environ.get(RANKS_SHARING_HOST_ENV, "1"))
    return time.process_time() + host_share


# ---- the host's side -----------------------------------------------------------------------------


class RankProcess:
    """The host's side: has the rank's process forked, forwards calls to it, kills it, and learns when it ends.
    ``ranks_sharing_host``: how many ranks the host serves, this one included (for ``rank_cpu_seconds``);
    ``on_end(how)`` runs once the process has ended, on a thread of its own."""

    def __init__(self, ranks_sharing_host: int, on_end: Callable[[str], None]):
        ends = [Pipe() for _ in range(3)]
        self.calls, self.control, self.faults = (mine for mine, _ in ends)
        self._control_lock = threading.Lock()
        self.ended = threading.Event()
        self.how_it_ended = ""
        theirs = [t for _, t in ends]
        self.child = fork_child(RANK_TARGET, [t.fileno() for t in theirs],
                                dict(os.environ, **{RANKS_SHARING_HOST_ENV: str(ranks_sharing_host)}))
        for t in theirs:
            t.close()

        def end(code: int) -> None:
            self.how_it_ended = describe_exit(code)
            self.ended.set()
            on_end(self.how_it_ended)

        watch(self.child, end)

    def build(self, *build_args: Any) -> None:
        """The first call: the rank builds (``ftexp.trainer.rank.Rank``'s arguments)."""
        self.call("__build__", *build_args)

    def call(self, method: str, *args: Any) -> Any:
        """A training-side call (one at a time): its result, or its exception raised here."""
        return ask(self.calls, (method, args), self.ended_error)

    def ask_control(self, method: str, *args: Any) -> Any:
        """A control call, answered by the rank process's control thread even while a call trains. One waits at
        most ``CONTROL_WAIT_S`` for the one before to be answered (``TimeoutError``), so a frozen process's
        unanswered calls hold only a few of the host's threads until it is killed."""
        if not self._control_lock.acquire(timeout=CONTROL_WAIT_S):
            raise TimeoutError(f"{WHERE} (pid {self.child.pid}) has not answered a control call for "
                               f"{CONTROL_WAIT_S:g} s")
        try:
            return ask(self.control, (method, args), self.ended_error)
        finally:
            self._control_lock.release()

    def inject_fault(self, mode: str) -> None:
        try:
            self.faults.send(mode)
        except OSError:
            raise self.ended_error() from None

    def kill(self) -> None:
        """SIGKILL the process (a no-op once it has ended); ``on_end`` follows."""
        self.child.kill()

    def ended_error(self) -> RankProcessEnded:
        """What a call on the ended process raises."""
        self.ended.wait(ENDED_REPORT_WAIT_S)
        return RankProcessEnded(f"{WHERE} (pid {self.child.pid}) has ended ({self.how_it_ended or 'its pipes closed'})")
