"""One fork server per node: the target's rank processes fork, ready, from a process that imported once.

A rank's process started as a fresh interpreter imports torch, the trainer, the engine (megatron-core
for its engine) and, when its optimizer is built, torch's compiler stack — about 6 CPU-seconds on
this project's 2-core machine before it builds anything — and every cell start, heal and warm spare
paid it again. The fork server imports all of that once, when its node starts, and forks a rank's
process from itself on request, in milliseconds; the child shares the server's pages until it writes
them. The server is started before the node's Ray processes (they and their workers inherit its
address in ``FORKSERVER_ENV``) and ends with the process that started it.

One request per rank process, on a ``SOCK_SEQPACKET`` Unix socket, from the actor that will host the
rank (``ftexp.trainer.rank_process``):

1. the actor connects and sends its pid and environment, with five descriptors attached: the rank's
   calls, control and faults pipe ends, and the actor's own stdout and stderr (so the rank's log
   lines reach the actor's log, as a child of the actor's would);
2. the server forks; the child takes the descriptors and the environment and runs the target (the
   rank's ``serve``); the server answers the child's pid;
3. when the child ends, the server sends its exit code (negative: the signal) and closes the connection;
   when the connection closes first — the actor died — the server SIGKILLs the child, which works
   even on a frozen (stopped) one.

The server is single-threaded — one selector over its socket, its connections and its children's
pidfds — so a fork copies no lock that another thread holds, and it never runs torch itself, so a
child starts before any thread pool exists. Its children get SIGKILL from the kernel when it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from ftexp.trainer.rank import serve
from ftexp.trainer.rank_process import ACTOR_PID_ENV, DESCRIPTORS, EXIT_CODE, FORKSERVER_ENV, MAX_REQUEST_BYTES, PID

PR_SET_PDEATHSIG = 1  # prctl option: the signal the kernel sends this process when its parent dies


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the parent dies; exit now if it already has."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


# ---- starting and ending a server -----------------------------------------------------------------


@contextlib.contextmanager
def rank_forkserver(preload: tuple[str, ...]) -> Iterator[str]:
    """A fork server for this node while the block runs, importing ``preload`` (with the rank's module and torch's
    compiler stack); its address in ``FORKSERVER_ENV`` for whatever this process starts meanwhile (Ray).

    The listening socket is bound here and handed to the server, so a request made before the server has
    finished importing waits in the socket's backlog instead of failing."""
    directory = tempfile.mkdtemp(prefix="ftexp-rfs-")  # short: a Unix socket path holds ~100 bytes
    path = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    package_root = str(Path(__file__).resolve().parents[2])  # where ``ftexp`` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")  # the ranks' log lines reach their actors' logs as they are written
    server = subprocess.Popen([sys.executable, "-m", "ftexp.trainer.rank_forkserver", str(os.getpid()),
                               str(listener.fileno()), *preload], pass_fds=[listener.fileno()], env=env)
    listener.close()
    previous = os.environ.get(FORKSERVER_ENV)
    os.environ[FORKSERVER_ENV] = path
    try:
        yield path
    finally:
        if previous is None:
            os.environ.pop(FORKSERVER_ENV, None)
        else:
            os.environ[FORKSERVER_ENV] = previous
        server.kill()  # its children get SIGKILL with it
        server.wait()
        with contextlib.suppress(OSError):
            os.unlink(path)
            os.rmdir(directory)


# ---- the server ----------------------------------------------------------------------------------


class ForkServer:
    """The server's loop: accept, fork, and report each child's end to the actor that asked for it."""

    def __init__(self, listener: socket.socket, target: Callable[[list[Connection]], None]):
        self.listener, self.target = listener, target
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its actor's connection, its pidfd)

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        try:
            message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, DESCRIPTORS)
            request = pickle.loads(message)
        except (OSError, pickle.UnpicklingError, EOFError):
            conn.close()
            return
        if len(fds) != DESCRIPTORS:
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(fds, request)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, lambda _, pid=pid: self._ended(pid))
        self.selector.register(conn, selectors.EVENT_READ, lambda _, pid=pid: self._actor_gone(pid))
        with contextlib.suppress(OSError):
            conn.send(PID.pack(pid))

    def _child(self, fds: list[int], request: dict[str, Any]) -> None:
        """In the forked child: drop the server's descriptors, take the actor's, serve; never returns."""
        try:
            self.selector.close()
            self.listener.close()
            for conn, pidfd in self.children.values():
                conn.close()
                os.close(pidfd)
            calls, control, faults, stdout, stderr = fds
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            os.close(stdout)
            os.close(stderr)
            os.environ.clear()
            os.environ.update(request["env"], **{ACTOR_PID_ENV: str(request["actor_pid"])})
            die_with_parent(self.pid)
            self.target([Connection(calls), Connection(control), Connection(faults)])
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)

    def _ended(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        with contextlib.suppress(KeyError):  # unless the actor's end closed first
            self.selector.unregister(conn)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.send(EXIT_CODE.pack(os.waitstatus_to_exitcode(status)))
        conn.close()

    def _actor_gone(self, pid: int) -> None:
        """The actor's end of the connection closed (it died): its rank's process must not outlive it."""
        conn, _ = self.children[pid]
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """``python -m ftexp.trainer.rank_forkserver <starter pid> <listening fd> <module>...``"""
    starter_pid, listener_fd, *preload = argv
    die_with_parent(int(starter_pid))
    listener = socket.socket(fileno=int(listener_fd))
    # torch's compiler stack: a torch optimizer imports it when it is built (~2.4 CPU-seconds).
    for name in ("torch._dynamo", *preload):
        importlib.import_module(name)
    ForkServer(listener, serve).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
