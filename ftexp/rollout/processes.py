"""What the rollout package's processes share: the hub kept offline, loopback ports, ending a process group.

Every process that may load a tokenizer or model (engines, the router, sglang servers) gets
`OFFLINE_ENV`: what it loads is a local directory, and nothing of a run may leave 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def stay_offline() -> None:
    """`OFFLINE_ENV` in this process's environment (before transformers is first imported: it reads it then)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS's pick); the caller binds it soon after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def end_process_group(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM the group `process` leads (started with ``start_new_session``), SIGKILL it if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    process.poll()
