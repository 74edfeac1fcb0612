"""The multi-node bootstrap's pieces that need no cluster: addresses, the tasks' meeting files, the join timeout."""

import pytest

from ftexp.faults.nodes import NodeFiles
from ftexp.launch.ray_cluster import ClusterError, node_ip, run_worker


def test_addresses_stay_on_loopback_unless_a_node_has_its_own(monkeypatch):
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    assert node_ip(True) == "127.0.0.1"
    assert node_ip(None) == "127.0.0.1"  # not under Slurm: one machine


def test_the_tasks_meet_through_files(tmp_path):
    head, node = NodeFiles(tmp_path / "cluster"), NodeFiles(tmp_path / "cluster")
    assert node.wait_for("head", 0.3) is None
    head.publish("head", {"gcs_address": "127.0.0.1:1234"})
    assert node.wait_for("head", 1.0) == {"gcs_address": "127.0.0.1:1234"}
    head.request_down(1, "test")
    assert node.take_request(1, "down")["why"] == "test" and node.take_request(1, "down") is None  # consumed once
    node.write_state(1, "down", down_at=5.0, ray_node_id="abc")
    node.write_state(1, "up", up_at=7.0)
    assert head.read_state(1) == {"state": "up", "down_at": 5.0, "up_at": 7.0, "ray_node_id": "abc"}
    node.mark_failed(1, "boom")
    assert head.failed_tasks() == {1: "boom"} and not node.finished()
    head.finish()
    assert node.finished()


def test_a_worker_whose_head_never_comes_fails_with_one_clear_error(tmp_path):
    with pytest.raises(ClusterError, match="node1: the head .task 0. did not publish its address within 0.5 s"):
        run_worker(NodeFiles(tmp_path / "cluster"), 1, "127.0.0.1", num_cpus=1, join_timeout_s=0.5, preload=())
    done = NodeFiles(tmp_path / "done")
    done.finish()
    run_worker(done, 1, "127.0.0.1", num_cpus=1, join_timeout_s=30, preload=())  # the job already ended: nothing to join
