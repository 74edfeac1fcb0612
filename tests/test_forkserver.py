"""The fork server: a forked child runs the target it was asked for, takes the asker's descriptors and
environment, its end reaches the asker as its exit code, the asker can have it killed, and it
outlives neither the asker (even frozen) nor the server.

The server here is the real ``ForkServer`` loop in a process of its own, forking a small target
defined below instead of a rank's or an engine's; the asker is this test process or a child of it.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

import pytest
import ray  # noqa: F401  (puts Ray's psutil on sys.path)
import psutil  # noqa: E402

from ftexp.forkserver import ASKER_PID_ENV, FORKSERVER_ENV, ForkServer, fork_child, forkserver

HERE = Path(__file__).resolve().parent
DIES_WITHIN_S = 30.0


TARGET = "test_forkserver:echo_target"


def echo_target(connections: list[Connection]) -> None:
    """The forked child: answers requests on its calls pipe."""
    calls, _control, _faults = connections
    while True:
        request = calls.recv()
        if request == "who":
            calls.send((os.getpid(), os.environ.get("FTEXP_TEST_MARK"), os.environ.get(ASKER_PID_ENV)))
        elif request == "print":
            print("printed by the forked child", flush=True)
            calls.send("printed")
        elif request == "exit 3":
            os._exit(3)


def run_server(listener_fd: int) -> None:
    ForkServer(socket.socket(fileno=listener_fd)).serve_forever()


@pytest.fixture
def server(tmp_path, monkeypatch):
    """A fork server on a socket in ``tmp_path``, its address in this process's environment."""
    path = str(tmp_path / "rfs.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(8)
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_forkserver as t; t.run_server({listener.fileno()})"
    process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[listener.fileno()])
    listener.close()
    monkeypatch.setenv(FORKSERVER_ENV, path)
    yield process
    process.kill()
    process.wait()


def _ask(env: dict[str, str], target: str = TARGET):
    """A child for this process, with three pipes (as a rank has); this process's ends of them."""
    ends = [Pipe() for _ in range(3)]
    child = fork_child(target, [theirs.fileno() for _, theirs in ends], env)
    for _, theirs in ends:
        theirs.close()
    return child, ends[0][0]


def _stopped(pid: int, within_s: float = DIES_WITHIN_S) -> bool:
    """Whether the process is stopped within ``within_s`` (a signal lands when the kernel next schedules it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
            return True
        time.sleep(0.05)
    return False


def _dead(pid: int, within_s: float = DIES_WITHIN_S) -> bool:
    try:
        psutil.Process(pid).wait(timeout=within_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def test_the_child_takes_the_askers_environment_and_reports_its_exit_code(server):
    child, calls = _ask(dict(os.environ, FTEXP_TEST_MARK="from the asker"))
    calls.send("who")
    assert calls.recv() == (child.pid, "from the asker", str(os.getpid()))
    assert psutil.Process(child.pid).ppid() == server.pid
    calls.send("exit 3")
    assert child.wait() == 3


def test_a_child_killed_by_a_signal_reports_it_and_the_server_forks_on(server):
    first, _ = _ask(dict(os.environ))
    second, calls = _ask(dict(os.environ))
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    calls.send("who")
    assert calls.recv()[0] == second.pid


def test_the_child_writes_to_the_askers_stdout(tmp_path, server):
    # The asker is a process of its own whose stdout is a file: the child's print lands there.
    out = tmp_path / "asker.out"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_forkserver as t, os\n"
            "child, calls = t._ask(dict(os.environ)); calls.send('print'); assert calls.recv() == 'printed'\n")
    with out.open("w") as stdout:
        subprocess.run([sys.executable, "-c", code], stdout=stdout, check=True, timeout=60)
    assert "printed by the forked child" in out.read_text()


def test_a_frozen_child_dies_with_its_asker(tmp_path, server):
    # The asker waits for the child's first answer: the child is then past its own start-up.
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_forkserver as t, os, time\n"
            "child, calls = t._ask(dict(os.environ)); calls.send('who'); calls.recv()\n"
            "print(child.pid, flush=True); time.sleep(600)\n")
    asker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(asker.stdout.readline())
        os.kill(child_pid, signal.SIGSTOP)
        assert _stopped(child_pid), "the child did not stop"
    finally:
        asker.kill()
        asker.wait()
    assert _dead(child_pid), "the frozen child outlived the process it was forked for"


def test_a_kill_ends_a_frozen_child_and_its_asker_lives_on(server):
    first, _ = _ask(dict(os.environ))
    second, calls = _ask(dict(os.environ))
    os.kill(first.pid, signal.SIGSTOP)
    assert _stopped(first.pid), "the child did not stop"
    first.kill()
    assert _dead(first.pid), "the killed child lives on"
    assert first.wait() == -signal.SIGKILL
    first.kill()  # a no-op once it has ended
    calls.send("who")  # the asker's other child, and the server, go on
    assert calls.recv()[0] == second.pid


def test_the_children_die_with_the_server(server):
    child, _ = _ask(dict(os.environ))
    server.kill()
    assert _dead(child.pid), "a child outlived its fork server"
    assert child.wait() == -signal.SIGKILL


def test_without_a_server_the_ask_fails_with_one_clear_error(monkeypatch):
    monkeypatch.delenv(FORKSERVER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="no fork server on this node"):
        _ask(dict(os.environ))
    monkeypatch.setenv(FORKSERVER_ENV, "/nonexistent/rfs.sock")
    with pytest.raises(RuntimeError, match="did not answer"):
        _ask(dict(os.environ))


def test_a_target_the_server_cannot_import_is_refused_and_the_server_forks_on(server):
    with pytest.raises(RuntimeError, match="closed the connection without forking no_such_module:serve"):
        _ask(dict(os.environ), target="no_such_module:serve")
    child, calls = _ask(dict(os.environ))
    calls.send("who")
    assert calls.recv()[0] == child.pid


SYSTEM_PYTHON = Path("/usr/bin/python3")  # an interpreter another user may run (this venv's may sit under /root)


@pytest.mark.skipif(os.getuid() != 0 or not SYSTEM_PYTHON.exists(),
                    reason="asking as another user needs root to switch users, and a system python3")
def test_another_users_request_is_refused(monkeypatch):
    # The real server, on its abstract socket (which has no file permissions); the asker runs as nobody and
    # sends a well-formed request: the server closes the connection (0 bytes back) instead of forking.
    asker = ("import pickle, socket, sys\n"
             "sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); sock.connect('\\0' + sys.argv[1][1:])\n"
             "request = pickle.dumps({'target': 'os:getpid', 'asker_pid': 1, 'env': {}})\n"
             "try:\n"
             "    socket.send_fds(sock, [request], [1, 2]); print(len(sock.recv(8)))\n"
             "except (ConnectionResetError, BrokenPipeError):\n"
             "    print(0)  # closed before the request went out\n")
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # where the server finds this module's target
    with forkserver(preload=()) as address:
        assert address.startswith("@")
        result = subprocess.run([str(SYSTEM_PYTHON), "-c", asker, address], user=65534, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "0", "the server answered a request from another user"
        child, calls = _ask(dict(os.environ))  # its own user is served
        calls.send("who")
        assert calls.recv()[0] == child.pid
