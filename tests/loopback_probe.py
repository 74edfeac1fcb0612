"""Which sockets a process tree holds, and which of them are off 127.0.0.0/8 (for the loopback tests)."""

import re
import subprocess
from pathlib import Path

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


def foreign_sockets(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if not owners & pids:
            continue
        state, _, _, local, peer = line.split()[:5]
        if state == "LISTEN" and local.startswith(("0.0.0.0", "*", "[::]")):
            bad.append(line)  # listening on every interface
        elif not LOOPBACK.match(local) or not LOOPBACK.match(peer):
            bad.append(line)
    return bad
