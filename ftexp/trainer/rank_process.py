"""A rank's process: the rank's state and step live in a plain process beside its Ray actor.

Why a second process: a Ray actor with concurrency groups runs its methods on a pool thread, while
its main thread wakes every 10 ms to check for signals and takes the GIL each time. A training step
on that pool thread is preempted more and runs measurably slower than the same step in a plain
process. So the actor (``ftexp.trainer.cell_rank``, one for a cell's ranks on a node) is only the
ranks' address and supervisor: it has one such process per rank forked by its node's fork server
(``ftexp.trainer.rank_forkserver``: torch and the trainer already imported), forwards each call to its
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

import logging
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, Pipe
from typing import Any, Callable

log = logging.getLogger(__name__)
RANKS_IN_ACTOR_ENV = "FTEXP_RANKS_IN_ACTOR"  # how many rank processes the rank's actor hosts
ACTOR_PID_ENV = "FTEXP_RANK_ACTOR_PID"  # the rank's actor (the process's parent is the fork server)
FORKSERVER_ENV = "FTEXP_RANK_FORKSERVER"  # the node's fork server's socket path, inherited by its Ray workers
# The fork server's wire format (``ftexp.trainer.rank_forkserver``): a request is one pickled message with the
# descriptors attached; the answers are the child's pid, then its exit code.
DESCRIPTORS = 5  # calls, control, faults, the actor's stdout and stderr
MAX_REQUEST_BYTES = 1 << 20
PID, EXIT_CODE = struct.Struct("!q"), struct.Struct("!i")


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


def rank_cpu_seconds() -> float:
    """CPU seconds of the rank so far: this process's and its share of its actor's (split evenly among the ranks
    it hosts), which the rank costs too."""
    with open(f"/proc/{os.environ[ACTOR_PID_ENV]}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    utime, stime = int(fields[11]), int(fields[12])  # the stat file's 14th and 15th fields, in clock ticks
    actor_share = (utime + stime) / os.sysconf("SC_CLK_TCK") / int(os.environ.get(RANKS_IN_ACTOR_ENV, "1"))
    return time.process_time() + actor_share


# ---- the actor's side ----------------------------------------------------------------------------


class ForkedChild:
    """A process the node's fork server forked for this process: its pid, and ``wait()`` for its exit code."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid

    def wait(self) -> int:
        """Block until the process ends: its exit code, negative for the signal that ended it (the server's
        end counts as SIGKILL: its children die with it)."""
        data = self.sock.recv(EXIT_CODE.size)
        self.sock.close()
        return EXIT_CODE.unpack(data)[0] if len(data) == EXIT_CODE.size else -signal.SIGKILL


def fork_child(descriptors: list[int], env: dict[str, str]) -> ForkedChild:
    """Ask this node's fork server for a rank process that gets ``descriptors`` (calls, control, faults; this
    process's stdout and stderr are added) and ``env``. The child lives while this process does."""
    path = os.environ.get(FORKSERVER_ENV)
    if not path:
        raise RuntimeError(f"no rank fork server on this node ({FORKSERVER_ENV} is not set): the driver or node "
                           "launcher starts one before Ray")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        request = pickle.dumps({"actor_pid": os.getpid(), "env": env})
        socket.send_fds(sock, [request], [*descriptors, sys.stdout.fileno(), sys.stderr.fileno()])
        data = sock.recv(PID.size)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"the rank fork server at {path} did not answer: {e}") from e
    if len(data) != PID.size:
        sock.close()
        raise RuntimeError(f"the rank fork server at {path} closed the connection without forking")
    return ForkedChild(sock, PID.unpack(data)[0])


class RankProcess:
    """The actor's side: has the rank's process forked, forwards calls to it, and ends the actor when it ends.
    ``ranks_in_actor``: how many rank processes the actor hosts, this one included."""

    def __init__(self, ranks_in_actor: int):
        ends = [Pipe() for _ in range(3)]
        self.calls, self.control, self.faults = (mine for mine, _ in ends)
        self._control_lock = threading.Lock()
        theirs = [t for _, t in ends]
        self.child = fork_child([t.fileno() for t in theirs], dict(os.environ, **{RANKS_IN_ACTOR_ENV: str(ranks_in_actor)}))
        for t in theirs:
            t.close()
        threading.Thread(target=self._keep, name="rank-process-keeper", daemon=True).start()

    def build(self, *build_args: Any) -> None:
        """The first call: the rank builds (``ftexp.trainer.rank.Rank``'s arguments)."""
        self.call("__build__", *build_args)

    def _keep(self) -> None:
        """Wait for the rank's process to end, then end the actor the same way."""
        code = self.child.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.warning("the rank's process (pid %d) ended (%s); its actor ends too", self.child.pid, how)
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
