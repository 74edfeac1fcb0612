"""Every socket of a run — Ray, gloo, the TCPStore, submitit — stays on 127.0.0.1."""

import re
import subprocess
import sys
import time

import pytest
from loopback_probe import descendants, foreign_sockets

pytestmark = pytest.mark.e2e


def test_a_failure_run_uses_only_loopback(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ftexp", "mode=dp2", "scenario=with_failure",
                             f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen_sockets, bad = 0, []
    while proc.poll() is None:
        pids = descendants(proc.pid)
        out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True).stdout
        seen_sockets += sum(1 for ln in out.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", ln)} & pids)
        bad += foreign_sockets(pids)
        time.sleep(0.3)
    assert proc.returncode == 0
    assert seen_sockets > 0, "the probe saw no socket of the run at all"
    assert not bad, "\n".join(sorted(set(bad))[:20])
