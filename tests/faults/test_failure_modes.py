"""Each failure mode, run in a child process: the way it dies (or, for deadlock, freezes)."""

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from ftexp.control.failure_modes import FailureMode, inject_fault

CHILD = """
import sys, threading, time
from ftexp.control.failure_modes import inject_fault

def heartbeat():
    while True:
        print("beat", flush=True)
        time.sleep(0.01)

threading.Thread(target=heartbeat, daemon=True).start()
time.sleep(0.1)
print("inject", flush=True)
inject_fault(sys.argv[1])
print("returned", flush=True)
"""


def spawn(mode):
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONFAULTHANDLER": ""})


@pytest.mark.parametrize("mode, returncode", [
    ("sigkill", -signal.SIGKILL),
    ("exit", 1),
    ("segfault", -signal.SIGSEGV),
])
def test_crash_modes_end_the_process(mode, returncode):
    child = spawn(mode)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == returncode
    assert b"inject" in out and b"returned" not in out


def read_lines(child, seconds, until=None):
    """Whole lines the child prints within ``seconds`` (stopping early after the line ``until``)."""
    deadline, data = time.monotonic() + seconds, b""
    while (left := deadline - time.monotonic()) > 0 and (until is None or until not in data.splitlines()):
        if select.select([child.stdout], [], [], left)[0]:
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:
                break
            data += chunk
    return data.decode().splitlines()


def test_deadlock_freezes_every_python_thread():
    child = spawn("deadlock")
    try:
        lines = read_lines(child, 30.0, until=b"inject")
        assert lines.count("beat") >= 3  # the heartbeat ran before the injection
        assert lines[-1] == "inject"
        read_lines(child, 0.2)  # grace: beats printed before the GIL-holding sleep began
        assert read_lines(child, 1.0) == []  # the heartbeat thread is frozen ...
        assert child.poll() is None  # ... and the process is alive, not crashed
    finally:
        child.kill()
        child.wait(10)


def test_unknown_mode_is_rejected_before_anything_happens():
    with pytest.raises(ValueError, match="oom"):
        inject_fault("oom")
    assert [m.value for m in FailureMode] == ["sigkill", "exit", "segfault", "deadlock"]
