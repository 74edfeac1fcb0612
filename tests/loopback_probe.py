"""Which sockets a process tree holds, and which of them are off 127.0.0.0/8 (for the loopback tests)."""

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

LOOPBACK = re.compile(r"^(127\.|\[::ffff:127\.|\[::1\]|::1|\*|0\.0\.0\.0)")


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def socket_listing() -> str:
    """Every TCP socket of the machine with its owning processes (``ss -tanpH``)."""
    return subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout


def foreign_sockets(pids: set[int], listing: str | None = None) -> list[str]:
    """The socket lines of ``pids`` off 127.0.0.0/8 (or listening on every interface), in ``listing`` or a fresh one."""
    bad = []
    for line in (listing if listing is not None else socket_listing()).splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if not owners & pids:
            continue
        state, _, _, local, peer = line.split()[:5]
        if state == "LISTEN" and local.startswith(("0.0.0.0", "*", "[::]")):
            bad.append(line)  # listening on every interface
        elif not LOOPBACK.match(local) or not LOOPBACK.match(peer):
            bad.append(line)
    return bad


class WatchedRun(NamedTuple):
    result: subprocess.CompletedProcess
    sockets_seen: int  # sightings of sockets held by the tree's processes that ``counted`` picked
    foreign: list[str]  # every socket line of the tree seen off loopback


def run_watching_sockets(argv: list[str], cwd: Path, output: Path, interval_s: float = 0.3,
                         counted: Callable[[int], bool] = lambda pid: True) -> WatchedRun:
    """``python -m ftexp *argv`` in ``cwd`` (stdout and stderr into ``output``), its process tree's sockets
    listed every ``interval_s`` while it runs."""
    with open(output, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ftexp", *argv], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        seen, bad = 0, []
        while proc.poll() is None:
            pids = descendants(proc.pid)
            picked = {pid for pid in pids if counted(pid)}
            listing = socket_listing()
            seen += sum(1 for line in listing.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & picked)
            bad += foreign_sockets(pids, listing)
            time.sleep(interval_s)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, output.read_text(), "")
    return WatchedRun(result, seen, sorted(set(bad)))
