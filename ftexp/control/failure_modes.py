"""Ways to make the current process fail, modelled on torchft.

A rank's ``inject_fault`` RPC (to its node's rank host) has ``inject_fault(mode)`` called in the rank's
own process (the one that trains; the host then ends the rest of the rank's team):

- ``sigkill``  the process sends itself SIGKILL;
- ``exit``     ``os._exit(1)``: no cleanup, no ``finally`` blocks;
- ``segfault`` a call through a NULL C function pointer;
- ``deadlock`` libc ``sleep(600)`` called while holding the GIL, so every Python thread of the
  process (the one that answers heartbeats included) freezes; the process stays alive but silent.
"""

from __future__ import annotations

import ctypes
import enum
import os
import signal

DEADLOCK_SECONDS = 600


class FailureMode(enum.StrEnum):
    SIGKILL = "sigkill"
    EXIT = "exit"
    SEGFAULT = "segfault"
    DEADLOCK = "deadlock"


def inject_fault(mode: FailureMode | str) -> None:
    """Fail this process in the given way. Only ``deadlock`` ever returns (after 600 s)."""
    mode = FailureMode(mode)
    if mode is FailureMode.SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode is FailureMode.EXIT:
        os._exit(1)
    elif mode is FailureMode.SEGFAULT:
        ctypes.CFUNCTYPE(None)(0)()
    else:
        # PyDLL, unlike CDLL, does not release the GIL around the foreign call.
        ctypes.PyDLL(None).sleep(DEADLOCK_SECONDS)
