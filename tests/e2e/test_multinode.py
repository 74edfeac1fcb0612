"""launcher=slurm launcher.nodes=2: one Ray cluster across the job's nodes, a node lost and healed, loopback only.

Needs a Slurm cluster with at least two idle nodes and accounting, such as the one that
``SLURM_LOCAL_NODES=2 bash scripts/slurm_local.sh start`` brings up on this machine (two slurmd on
127.0.0.1; CI starts that one). Without it the tests skip; with ``FTEXP_REQUIRE_SLURM=1`` they fail.

The job's processes are not the CLI's descendants (slurmd starts them), so the socket probe finds
every process of the run, on every node, by a marker in the environment that sbatch passes to the
job and Ray to every process of its nodes.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from ftexp.faults.nodes import NodeFiles
from ftexp.launch.ray_cluster import socket_dir_prefix
from loopback_probe import foreign_sockets, socket_listing
from test_slurm import TIMEOUT_MIN, _slurm_unavailable

pytestmark = pytest.mark.e2e
MARK = "FTEXP_TEST_MARK"


@pytest.fixture(scope="module", autouse=True)
def two_nodes():
    reason = _slurm_unavailable()
    if reason is None:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30).stdout
        idle = {ln.split()[0] for ln in states.splitlines() if ln.split() and ln.split()[-1] in ("idle", "mix")}
        if len(idle) < 2:
            reason = (f"fewer than 2 idle Slurm nodes ({sorted(idle)}; `SLURM_LOCAL_NODES=2 bash scripts/slurm_local.sh "
                      f"start` starts a 2-node cluster on this machine)")
    if reason is None:
        return
    if os.environ.get("FTEXP_REQUIRE_SLURM") == "1":
        pytest.fail(f"FTEXP_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _marked(mark: str) -> dict[int, str]:
    """pid -> Slurm node name ('' outside a job step) of every process carrying the marker."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            env = _environ(int(entry.name))
            if env.get(MARK) == mark:
                out[int(entry.name)] = env.get("SLURMD_NODENAME", "")
    return out


def _events(events_dir: Path, kind: str) -> list[dict]:
    return [e for p in sorted(events_dir.glob("*.jsonl")) for ln in p.read_text().splitlines()
            if ln.strip() and (e := json.loads(ln))["type"] == kind]


def run_watched(cwd: Path, *overrides: str, timeout_s: float = 1200) -> tuple[int, str, dict[str, int], list[str]]:
    """``python -m ftexp overrides`` while a probe watches the sockets of every process of the run, on every node:
    (exit code, output, sockets seen per Slurm node name, the sockets off loopback)."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "ftexp", *overrides], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"})
    seen_nodes: dict[str, int] = {}
    bad: list[str] = []
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        marked = _marked(mark)
        out = socket_listing()
        for line in out.splitlines():
            owners = {int(p) for p in re.findall(r"pid=(\d+)", line)} & set(marked)
            for pid in owners:
                seen_nodes[marked[pid]] = seen_nodes.get(marked[pid], 0) + 1
        bad += foreign_sockets(set(marked), out)
        time.sleep(0.5)
    if proc.poll() is None:
        proc.kill()
    output = proc.communicate()[0]
    return proc.returncode, output, seen_nodes, bad


@pytest.mark.parametrize("how", ["ray", "slurm"])
def test_a_node_fault_on_two_nodes_shrinks_its_cells_together_heals_them_and_stays_on_loopback(tmp_path, how):
    """how=ray: node 1's Ray node is killed and its Slurm task brings a fresh one back; how=slurm: Slurm node n2 is
    set down, Slurm ends the job's task there, and a replacement node comes as a one-node job of its own."""
    run_dir = tmp_path / "run"
    returncode, output, seen_nodes, bad = run_watched(
        tmp_path, "mode=dp4", "scenario=node_failure", "launcher=slurm", "launcher.nodes=2",
        f"launcher.timeout_min={TIMEOUT_MIN}", f"hydra.run.dir={run_dir}", f"scenario.phases.0.target_actions.0.how={how}")
    assert returncode == 0, output[-4000:]
    assert (run_dir / "report.md").read_text().startswith("# ftexp verdict: PASSED")
    # every node of the job had sockets, and none of them left loopback
    assert len([n for n in seen_nodes if n]) >= 2, f"sockets seen per Slurm node: {seen_nodes}"
    assert not bad, "\n".join(sorted(set(bad))[:20])
    target = run_dir / "target" / "events"
    placed = {e["cell_index"]: e["rank_nodes"] for e in _events(target, "cell_placement") if e["incarnation"] == 1}
    assert placed == {0: [0], 1: [0], 2: [1], 3: [1]}  # two cells per node, each where it was planned
    reconfigures = [(e["rollout_id"], e["src_cell_index"], e["healed_cell_indices"], e["alive_cell_indices_after"])
                    for e in _events(target, "cell_reconfigure")]
    assert reconfigures == [(1, None, [], [0, 1]), (2, 0, [2, 3], [0, 1, 2, 3])]  # node 1's two cells, together
    [fault] = _events(target, "fault_injected")
    assert fault["node_index"] == 1 and fault["action"] == "kill_node_before_allreduce"
    [back] = _events(target, "node_state")
    assert back["state"] == "rejoined" and back["timings"]["rejoin_s"] > 0
    healed = {e["cell_index"]: e["rank_nodes"] for e in _events(target, "cell_placement") if e["incarnation"] == 2}
    assert healed == {2: [1], 3: [1]}  # the healed cells run on the node that came back
    replacements = list((run_dir / "target" / "submitit").glob("node1_replacement/*_submitted.pkl"))
    assert len(replacements) == (1 if how == "slurm" else 0), replacements
    # the baseline's world spanned both nodes too: each task forked its node's ranks
    log = (run_dir / "baseline" / "train.log").read_text()
    assert "node0 of 2" in log and "node1 of 2" in log
    # node 1's Ray socket files went with it, and with its replacement (how=slurm: Slurm ended the task itself)
    left = Path(tempfile.gettempdir()).glob(socket_dir_prefix(NodeFiles(run_dir / "target" / "cluster")) + "*")
    assert not list(left)
