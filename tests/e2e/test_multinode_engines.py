"""Live rollout engines in a 2-node Slurm job: the cells on node 0, the engines on a rollout node of their own.

``launcher.nodes=2`` with the dense real-rollout mode's one rollout node: node 0 trains (both cells, the
driver, the sglang router), node 1 serves the two engines — on the target as actors pinned to node 1 of
the job's Ray cluster, on the baseline as node 1's task's own engines. Every rollout crosses the nodes
through the router, and every weight update through the weight-update group; nothing leaves 127.0.0.0/8.
Needs the 2-node local Slurm cluster, as ``test_multinode`` does (skips without it).
"""

import pytest

from ftexp_runner import report_checks
from test_multinode import _events, run_watched, two_nodes  # noqa: F401  (two_nodes: the module's skip-unless fixture)
from test_slurm import TIMEOUT_MIN

pytestmark = pytest.mark.e2e
# 8 prompts x 4 samples, 2 engines, the no_failure scenario's 2 rollouts: one baseline and one target job
SMALL = ("trainer.rollout.rollout_batch_size=8", "trainer.rollout.n_samples_per_prompt=4", "mode.rollout_num_engines=2")


def test_engines_on_a_rollout_node_of_their_own_serve_both_sides_across_nodes_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    returncode, output, seen_nodes, bad = run_watched(
        tmp_path, "mode=dp2_cp2_real_rollout_dense", "scenario=no_failure", "launcher=slurm", "launcher.nodes=2",
        *SMALL, f"launcher.timeout_min={TIMEOUT_MIN}", f"hydra.run.dir={run_dir}", timeout_s=900)
    assert returncode == 0, output[-4000:]
    checks = report_checks(run_dir)
    assert all(c["passed"] for c in checks.values()), [c["summary"] for c in checks.values() if not c["passed"]]
    assert "node 0: cells [0, 1], node 1: engines [0, 1]" in checks["placement"]["summary"]
    assert len([n for n in seen_nodes if n]) >= 2, f"sockets seen per Slurm node: {seen_nodes}"
    assert not bad, "\n".join(sorted(set(bad))[:20])
    events = run_dir / "target" / "events"
    cells = {e["cell_index"]: e for e in _events(events, "cell_placement")}
    engines = {e["engine_index"]: e for e in _events(events, "engine_placement")}
    assert {c: e["rank_nodes"] for c, e in cells.items()} == {0: [0, 0], 1: [0, 0]}
    assert {i: (e["node"], e["planned_node"]) for i, e in engines.items()} == {0: (1, 1), 1: (1, 1)}
    # node 1 is another Ray node than the cells' one, and the engines serve on loopback
    assert {e["ray_node_id"] for e in engines.values()}.isdisjoint(i for e in cells.values() for i in e["ray_node_ids"])
    assert all(e["url"].startswith("http://127.0.0.1:") for e in engines.values())
    # both sides' engines were fed after every rollout (the weight-update group across the nodes)
    assert checks["baseline_engine_updates"]["passed"] and checks["target_engine_updates"]["passed"]
    # the baseline's engines ran in node 1's task, the router on node 0 over them
    log = (run_dir / "baseline" / "train.log").read_text()
    assert "baseline node1 (a rollout node): engines [0, 1]" in log
