"""The body of one task of a multi-node training job (one Slurm task per node).

Target side: task 0 starts the Ray head, waits until every node has joined (``launcher.ray.join_timeout_s``,
else one clear error) and runs the driver, which pins each cell to its nodes; task i runs a Ray worker
node until task 0 is done (``ftexp.launch.ray_cluster``). Baseline side: task 0 hosts the world's
TCPStore, and every task forks the baseline ranks placed on its node (``ftexp.trainer.baseline``).
"""

from __future__ import annotations

import logging
import os
import time

import ray
import submitit

from ftexp.faults.nodes import NodeFiles
from ftexp.job import JobSpec
from ftexp.launch.ray_cluster import ClusterError, node_ip, run_worker, start_head, wait_for_nodes
from ftexp.rundir import BASELINE
from ftexp.trainer.baseline import run_baseline
from ftexp.trainer.driver import run_ft_driver

log = logging.getLogger(__name__)


def run_on_node(spec: JobSpec) -> None:
    env = submitit.JobEnvironment()
    node, tasks = env.global_rank, env.num_tasks
    if tasks != spec.nodes:
        raise ClusterError(f"the job has {tasks} task(s) but its placement {spec.nodes} nodes (one task per node)")
    files = NodeFiles(spec.side_dir.cluster)
    cluster = spec.cluster
    ip = node_ip(cluster.loopback)
    log.info("node%d of %d: Slurm node %s, address %s", node, tasks, os.environ.get("SLURMD_NODENAME", "?"), ip)
    if spec.side == BASELINE:
        run_baseline(spec, node, files, ip, cluster.join_timeout_s)
    elif node == 0:
        try:
            t0 = time.monotonic()
            start_head(files, ip, num_cpus=2)
            wait_for_nodes(list(range(spec.nodes)), cluster.join_timeout_s)
            log.info("ray cluster: all %d nodes up %.1f s after the head started", spec.nodes, time.monotonic() - t0)
            run_ft_driver(spec)
        finally:
            files.finish()  # the worker nodes' supervisors end their nodes and return
            if ray.is_initialized():
                ray.shutdown()
    else:
        run_worker(files, node, ip, num_cpus=2, join_timeout_s=cluster.join_timeout_s)
