"""A rank's process: the rank's state and step live in a plain child process of its Ray actor.

Why a second process: a Ray actor with concurrency groups runs its methods on a pool thread, while
its main thread wakes every 10 ms to check for signals and takes the GIL each time. A training step
on that pool thread is preempted more and runs measurably slower than the same step in a plain
process. So the actor (``ftexp.trainer.cell_rank``, one for a cell's ranks on a node) is only the
ranks' address and supervisor: it starts one such process per rank, forwards each call to its rank's,
and the processes that train have no Ray inside.

Three pipes, each a request/answer channel served by one thread of the rank's process:

- ``calls``: init, reconfigure, train, update_weights, save — one at a time, each answered with its
  result or its exception; served by the process's main thread;
- ``control``: ping, heartbeat, release_collectives — answered by the process's control thread, so
  a frozen process answers nothing (liveness stays "the RPC returned"), while a training call does
  not hold them up;
- ``faults``: the fault to inject, run by the control thread in the process that trains (no answer).

The actor and its ranks' processes die together. A rank's process gets SIGKILL from the kernel when
its actor dies (parent-death signal: it works even while the process is frozen). The actor's keeper
thread for each rank waits for that rank's process and, once it has ended, ends the actor too
(SIGKILL, or the same exit code), and with it the other ranks' processes: Ray then reports the death
of the actor's ranks, and lifelines, the death watch and the control plane see a dead cell as they
would see it with an actor per rank. An actor's call whose answer the death cut off waits for that
end instead of raising.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # prctl option: the signal the kernel sends this process when its parent dies
RANKS_IN_ACTOR_ENV = "FTEXP_RANKS_IN_ACTOR"  # how many rank processes the parent actor hosts


# Errors that travel to the actor as themselves: unpickling one imports its class's module there, and
# the actor does without torch (an import of it would hold the actor's GIL for seconds, stalling the
# heartbeats it serves). Any other error travels as a RuntimeError that names its type.
LIGHT_ERROR_MODULES = ("builtins", "ftexp.errors")


def answer(conn: Connection, work: Callable[[], Any]) -> None:
    """Run ``work`` and send ``("ok", result)``, or ``("error", exception)`` with the traceback as a note."""
    try:
        reply: tuple[str, Any] = ("ok", work())
    except Exception as e:
        e.add_note("in the rank's process:\n" + "".join(traceback.format_exception(e)).rstrip())
        reply = ("error", _sendable(e))
    try:
        conn.send(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a result that does not pickle
        conn.send(("error", RuntimeError(f"the rank's answer could not be sent: {e}")))


def _sendable(error: Exception) -> Exception:
    """``error`` itself if the actor can take it lightly, else a RuntimeError naming its type, message and notes."""
    if type(error).__module__ in LIGHT_ERROR_MODULES:
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            pass
    kind = type(error).__qualname__ if type(error).__module__ == "builtins" \
        else f"{type(error).__module__}.{type(error).__qualname__}"
    return RuntimeError(f"{kind}: {error}\n" + "\n".join(getattr(error, "__notes__", [])))


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the parent dies; exit now if it already has."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def rank_cpu_seconds() -> float:
    """CPU seconds of the rank so far: this process's and its share of its actor's (the parent's, split evenly
    among the ranks it hosts), which the rank costs too."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # the stat file's 14th and 15th fields, in clock ticks
    actor_share = (utime + stime) / os.sysconf("SC_CLK_TCK") / int(os.environ.get(RANKS_IN_ACTOR_ENV, "1"))
    return time.process_time() + actor_share


def child_connections(argv: list[str]) -> tuple[int, list[Connection]]:
    """The parent's pid and the (calls, control, faults) ends, from the rank process's command line."""
    parent_pid, *fds = (int(a) for a in argv)
    return parent_pid, [Connection(fd) for fd in fds]


class RankProcess:
    """The actor's side: starts the rank's process, forwards calls to it, and ends the actor when it ends.
    ``ranks_in_actor``: how many rank processes the actor hosts, this one included."""

    def __init__(self, ranks_in_actor: int = 1):
        self.ranks_in_actor = ranks_in_actor
        ends = [Pipe() for _ in range(3)]
        self.calls, self.control, self.faults = (mine for mine, _ in ends)
        self._control_lock = threading.Lock()
        theirs = [t for _, t in ends]
        started = threading.Event()
        # The process is started by a thread that lives as long as the actor: the parent-death signal is
        # sent when the thread that started the child ends, not only when the whole process does.
        threading.Thread(target=self._keep, args=(theirs, started), name="rank-process-keeper", daemon=True).start()
        started.wait()
        for t in theirs:
            t.close()

    def build(self, *build_args: Any) -> None:
        """The first call: the rank builds (``ftexp.trainer.rank.Rank``'s arguments)."""
        self.call("__build__", *build_args)

    def _keep(self, theirs: list[Connection], started: threading.Event) -> None:
        fds = [t.fileno() for t in theirs]
        package_root = str(Path(__file__).resolve().parents[2])  # where ``ftexp`` is importable from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1",  # its log lines reach the actor's log as they are written
                   **{RANKS_IN_ACTOR_ENV: str(self.ranks_in_actor)})
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from ftexp.trainer.rank import serve; serve(sys.argv[1:])",
             str(os.getpid()), *map(str, fds)], pass_fds=fds, env=env)
        started.set()
        code = process.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.warning("the rank's process (pid %d) ended (%s); its actor ends too", process.pid, how)
        sys.stdout.flush()
        sys.stderr.flush()
        if code < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code or 1)

    def call(self, method: str, *args: Any) -> Any:
        """A training-side call (one at a time): its result, or its exception raised here."""
        return self._ask(self.calls, (method, args))

    def ask_control(self, method: str, *args: Any) -> Any:
        """A control call, answered by the rank process's control thread even while a call trains."""
        with self._control_lock:
            return self._ask(self.control, (method, args))

    def inject_fault(self, mode: str) -> None:
        self.faults.send(mode)

    @staticmethod
    def _ask(conn: Connection, request: tuple) -> Any:
        try:
            conn.send(request)
            kind, value = conn.recv()
        except (EOFError, OSError):  # the rank's process died: the keeper ends this actor in a moment
            threading.Event().wait()
        if kind == "error":
            raise value
        return value
