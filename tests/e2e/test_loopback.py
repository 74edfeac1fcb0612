"""Every socket of a run — Ray, gloo, the TCPStore, submitit — stays on 127.0.0.1."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
LOOPBACK = re.compile(r"^(127\.|\[::ffff:127\.|\[::1\]|::1|\*|0\.0\.0\.0)")


def _descendants(root: int) -> set[int]:
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


def _foreign_sockets(pids: set[int]) -> list[str]:
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


def test_a_failure_run_uses_only_loopback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ftexp", "mode=dp2", "scenario=with_failure",
                             f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen_sockets, bad = 0, []
    while proc.poll() is None:
        pids = _descendants(proc.pid)
        out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout
        seen_sockets += sum(1 for ln in out.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", ln)} & pids)
        bad += _foreign_sockets(pids)
        time.sleep(0.3)
    assert proc.returncode == 0
    assert seen_sockets > 0, "the probe saw no socket of the run at all"
    assert not bad, "\n".join(sorted(set(bad))[:20])
