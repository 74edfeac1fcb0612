"""One fork server per node: the processes that train or serve fork, ready, from one that imported once.

A rank's process or a rollout engine's, started as a fresh interpreter, imports torch and what it runs
(the trainer and megatron-core for a rank, transformers, FastAPI and uvicorn for an engine) before it
does anything: 6–8 CPU-seconds each on this project's 2-core machine, paid again at every cell start,
heal, warm spare and engine start. The fork server imports all of that once, when its node starts, and
forks a ready process from itself on request, in milliseconds; the child shares the server's pages
until it writes them. It is started before the node's Ray processes (they and their workers inherit
its address in ``FORKSERVER_ENV``) and ends with the process that started it.

One request per child, on an abstract ``SOCK_SEQPACKET`` Unix socket (nothing on disk; only the
server's own user may ask), from the process that will own the child (its "asker", a Ray actor:
``ftexp.trainer.rank_process``, ``ftexp.rollout.engine``):

1. the asker connects and sends its pid, its environment and the child's target (``module:function``),
   with descriptors attached: the target's pipe ends, then the asker's own stdout and stderr (so the
   child's log lines reach the asker's log, as a child of the asker's would);
2. the server forks; the child takes the descriptors and the environment and runs
   ``function(connections)``; the server answers the child's pid;
3. when the child ends, the server sends its exit code (negative: the signal) and closes the connection;
   when the asker's side closes first — it died, or it asked for the child's end — the server SIGKILLs
   the child, which works even on a frozen (stopped) one.

The server is single-threaded — one selector over its socket, its connections and its children's
pidfds — so a fork copies no lock that another thread holds, and it never runs torch itself, so a
child starts before any thread pool exists. Its children get SIGKILL from the kernel when it dies.

Over a child's pipes, ``answer`` sends a call's result or its exception and ``ask`` returns it or
re-raises it. ``watch`` tells the asker when its child ends; ``end_with`` ends the asker then, so the
two die together either way (a rollout engine's actor and its process).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import pickle
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)
FORKSERVER_ENV = "FTEXP_FORKSERVER"  # the node's fork server's socket address, inherited by its Ray workers
ASKER_PID_ENV = "FTEXP_FORKED_FOR"  # in a child: the pid of the process it was forked for (its parent is the server)
MAX_DESCRIPTORS = 8  # a target's pipe ends, plus the asker's stdout and stderr
MAX_REQUEST_BYTES = 1 << 20
PID, EXIT_CODE = struct.Struct("!q"), struct.Struct("!i")
PEER_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: the asker's pid, uid, gid
PR_SET_PDEATHSIG = 1  # prctl option: the signal the kernel sends this process when its parent dies

# Errors that travel to the asker as themselves: unpickling one imports its class's module there, and an
# asker does without torch (an import of it would hold a Ray actor's GIL for seconds, stalling the calls it
# serves). Any other error travels as a RuntimeError that names its type.
LIGHT_ERROR_MODULES = ("builtins", "ftexp.errors")


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGKILL when the parent dies; exit now if it already has."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


# ---- starting and ending a server -----------------------------------------------------------------


@contextlib.contextmanager
def forkserver(preload: tuple[str, ...]) -> Iterator[str]:
    """A fork server for this node while the block runs, importing the modules ``preload`` names; its address in
    ``FORKSERVER_ENV`` for whatever this process starts meanwhile (Ray).

    The listening socket is bound here and handed to the server, so a request made before the server has
    finished importing waits in the socket's backlog instead of failing."""
    # An abstract socket (Linux): nothing on disk to clean up, even when this process is SIGKILLed.
    address = f"@ftexp-forkserver-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(_socket_name(address))
    listener.listen(64)
    package_root = str(Path(__file__).resolve().parents[1])  # where ``ftexp`` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")  # the children's log lines reach their askers' logs as they are written
    server = subprocess.Popen([sys.executable, "-m", "ftexp.forkserver", str(os.getpid()),
                               str(listener.fileno()), *preload], pass_fds=[listener.fileno()], env=env)
    listener.close()
    previous = os.environ.get(FORKSERVER_ENV)
    os.environ[FORKSERVER_ENV] = address
    try:
        yield address
    finally:
        if previous is None:
            os.environ.pop(FORKSERVER_ENV, None)
        else:
            os.environ[FORKSERVER_ENV] = previous
        server.kill()  # its children get SIGKILL with it
        server.wait()


def _socket_name(address: str) -> str:
    """The name to bind or connect: ``@name`` is the abstract socket ``name`` (an environment variable holds no
    NUL byte), anything else a path."""
    return "\0" + address[1:] if address.startswith("@") else address


# ---- the server ----------------------------------------------------------------------------------


class ForkServer:
    """The server's loop: accept, fork, and report each child's end to the process that asked for it."""

    def __init__(self, listener: socket.socket):
        self.listener = listener
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.children: dict[int, tuple[socket.socket, int]] = {}  # pid -> (its asker's connection, its pidfd)

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        fds: list[int] = []
        try:
            # An abstract socket has no file permissions: only this user's processes may ask.
            _, uid, _ = PEER_CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                PEER_CREDENTIALS.size))
            if uid != os.getuid():
                raise PermissionError(f"a request from uid {uid} refused")
            message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_DESCRIPTORS)
            request = pickle.loads(message)
            target = _resolve(request["target"])  # imported here, once, if the preload did not
            if len(fds) < 2:
                raise ValueError(f"{len(fds)} descriptor(s) attached; the asker's stdout and stderr come last")
        except Exception:
            traceback.print_exc()  # the asker sees its connection closed without a pid
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(target, fds, request)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (conn, pidfd)
        self.selector.register(pidfd, selectors.EVENT_READ, lambda _, pid=pid: self._ended(pid))
        self.selector.register(conn, selectors.EVENT_READ, lambda _, pid=pid: self._asker_gone(pid))
        with contextlib.suppress(OSError):
            conn.send(PID.pack(pid))

    def _child(self, target: Callable[[list[Connection]], None], fds: list[int], request: dict[str, Any]) -> None:
        """In the forked child: drop the server's descriptors, take the asker's, run the target; never returns."""
        try:
            self.selector.close()
            self.listener.close()
            for conn, pidfd in self.children.values():
                conn.close()
                os.close(pidfd)
            *pipes, stdout, stderr = fds
            os.dup2(stdout, 1)
            os.dup2(stderr, 2)
            os.close(stdout)
            os.close(stderr)
            os.environ.clear()
            os.environ.update(request["env"], **{ASKER_PID_ENV: str(request["asker_pid"])})
            die_with_parent(self.pid)
            target([Connection(fd) for fd in pipes])
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)

    def _ended(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        self.selector.unregister(pidfd)
        with contextlib.suppress(KeyError):  # unless the asker's end closed first
            self.selector.unregister(conn)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.send(EXIT_CODE.pack(os.waitstatus_to_exitcode(status)))
        conn.close()

    def _asker_gone(self, pid: int) -> None:
        """The asker's end of the connection closed (it died): its child must not outlive it."""
        conn, _ = self.children[pid]
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _resolve(target: str) -> Callable[[list[Connection]], None]:
    """``module:function`` -> the function."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: list[str]) -> None:
    """``python -m ftexp.forkserver <starter pid> <listening fd> <module>...``"""
    starter_pid, listener_fd, *preload = argv
    die_with_parent(int(starter_pid))
    listener = socket.socket(fileno=int(listener_fd))
    for name in preload:
        importlib.import_module(name)
    ForkServer(listener).serve_forever()


# ---- the asker's side ----------------------------------------------------------------------------


class ForkedChild:
    """A process the node's fork server forked for this process: its pid, ``wait()`` for its exit code, and
    ``kill()``."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self._closing = threading.Lock()  # a kill never shuts down a closed socket's reused descriptor

    def wait(self) -> int:
        """Block until the process ends: its exit code, negative for the signal that ended it (the server's
        end counts as SIGKILL: its children die with it)."""
        data = self.sock.recv(EXIT_CODE.size)
        with self._closing:
            self.sock.close()
        return EXIT_CODE.unpack(data)[0] if len(data) == EXIT_CODE.size else -signal.SIGKILL

    def kill(self) -> None:
        """Have the server SIGKILL the process, as if this one had died: closing our side of the connection
        tells it to. The server, the process's parent, signals it before it can be reaped, so the signal
        never reaches a reused pid; ``wait`` still gets the exit code. A no-op once it has ended."""
        with self._closing, contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)


def fork_child(target: str, descriptors: list[int], env: dict[str, str]) -> ForkedChild:
    """Ask this node's fork server for a process that runs ``target`` (``module:function``) on ``descriptors``
    (this process's stdout and stderr are added) with ``env``. The child lives while this process does."""
    address = os.environ.get(FORKSERVER_ENV)
    if not address:
        raise RuntimeError(f"no fork server on this node ({FORKSERVER_ENV} is not set): the driver or node "
                           "launcher starts one before Ray")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(_socket_name(address))
        request = pickle.dumps({"target": target, "asker_pid": os.getpid(), "env": env})
        socket.send_fds(sock, [request], [*descriptors, sys.stdout.fileno(), sys.stderr.fileno()])
        data = sock.recv(PID.size)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"the fork server at {address} did not answer: {e}") from e
    if len(data) != PID.size:
        sock.close()
        raise RuntimeError(f"the fork server at {address} closed the connection without forking {target} "
                           "(its log says why)")
    return ForkedChild(sock, PID.unpack(data)[0])


def describe_exit(code: int) -> str:
    """An exit code as ``wait`` returns it, in words: "signal SIGKILL" or "exit code 1"."""
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def watch(child: ForkedChild, on_end: Callable[[int], None]) -> None:
    """Call ``on_end(exit code)`` on a thread of its own once ``child`` has ended."""
    threading.Thread(target=lambda: on_end(child.wait()), name="forked-child-watch", daemon=True).start()


def end_with(child: ForkedChild, what: str) -> None:
    """From now on, this process ends when ``child`` does, the same way (killed by a signal: SIGKILL; else its
    exit code). ``what``: the child, for the log line ("the rollout engine's process")."""

    def end(code: int) -> None:
        log.warning("%s (pid %d) ended (%s); the process it was forked for (pid %d) ends too", what, child.pid,
                    describe_exit(code), os.getpid())
        sys.stdout.flush()
        sys.stderr.flush()
        if code < 0:
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(code or 1)

    watch(child, end)


# ---- calls over a child's pipes ------------------------------------------------------------------


def ask(conn: Connection, request: Any, ended: Callable[[], Exception] | None = None) -> Any:
    """Send ``request`` to the child and return its answer, or raise the error it answered. If the child died:
    raise ``ended()``, or without it wait for `end_with`'s thread to end this process."""
    try:
        conn.send(request)
        kind, value = conn.recv()
    except (EOFError, OSError):
        if ended is not None:
            raise ended() from None
        threading.Event().wait()
    if kind == "error":
        raise value
    return value


def answer(conn: Connection, work: Callable[[], Any], where: str) -> None:
    """Run ``work`` and send ``("ok", result)``, or ``("error", exception)`` with the traceback as a note that
    says ``where`` it ran ("the rank's process")."""
    try:
        reply: tuple[str, Any] = ("ok", work())
    except Exception as e:
        e.add_note(f"in {where}:\n" + "".join(traceback.format_exception(e)).rstrip())
        reply = ("error", _sendable(e))
    try:
        conn.send(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a result that does not pickle
        conn.send(("error", RuntimeError(f"the answer of {where} could not be sent: {e}")))


def _sendable(error: Exception) -> Exception:
    """``error`` itself if the asker can take it lightly, else a RuntimeError naming its type, message and notes."""
    if type(error).__module__ in LIGHT_ERROR_MODULES:
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            pass
    kind = type(error).__qualname__ if type(error).__module__ == "builtins" \
        else f"{type(error).__module__}.{type(error).__qualname__}"
    return RuntimeError(f"{kind}: {error}\n" + "\n".join(getattr(error, "__notes__", [])))


if __name__ == "__main__":
    main(sys.argv[1:])
