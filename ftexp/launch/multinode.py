"""The body of one task of a multi-node training job (one Slurm task per node).

Target side: task 0 starts the Ray head, waits until every node has joined (``launcher.ray.join_timeout_s``,
else one clear error) and runs the driver, which pins each cell to its nodes; task i runs a Ray worker
node until task 0 is done (``ftexp.launch.ray_cluster``). Baseline side: task 0 hosts the world's
TCPStore, and every task forks the baseline ranks placed on its node (``ftexp.trainer.baseline``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

import ray
import submitit

from ftexp.faults.nodes import NodeFiles
from ftexp.forkserver import forkserver
from ftexp.job import JobSpec
from ftexp.launch.ray_cluster import ClusterError, node_ip, run_worker, start_head, wait_for_nodes
from ftexp.rundir import BASELINE
from ftexp.trainer.baseline import run_baseline
from ftexp.trainer.driver import forkserver_preload, run_ft_driver

log = logging.getLogger(__name__)


class NodeReplacer:
    """On the head: a node that Slurm took away (a ``how: slurm`` node fault) has no task left to bring it back,
    so when the driver asks for it (``node<i>.up``) a replacement comes as a new one-node job of its own, whose
    task starts a Ray node with the lost node's ``node<i>`` resource and supervises it like any worker task."""

    def __init__(self, spec: JobSpec, files: NodeFiles):
        self.spec, self.files = spec, files
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-replacer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i in range(1, self.spec.nodes):
                state = self.files.read_state(i) or {}
                if state.get("state") == "down" and state.get("how") == "slurm" and self.files.take_request(i, "up"):
                    try:
                        self._replace(i)
                    except Exception as e:  # the driver's wait for the node then fails with its own clear error
                        log.error("node%d: could not submit a replacement node: %s", i, e)

    def _replace(self, index: int) -> None:
        launcher = self.spec.launcher
        executor = submitit.SlurmExecutor(folder=self.spec.side_dir.submitit / f"node{index}_replacement",
                                          max_num_timeout=0)
        options = {"partition": launcher.partition, "account": launcher.account,
                   "cpus_per_task": launcher.cpus_per_task, "gpus_per_node": launcher.gpus_per_node}
        executor.update_parameters(time=launcher.timeout_min, nodes=1, job_name="ftexp-node",
                                   additional_parameters=dict(launcher.additional_parameters),
                                   **{k: v for k, v in options.items() if v is not None})
        with submitit.helpers.clean_env():  # this is a job itself: do not let submitit take the new job for it
            job = executor.submit(run_replacement_node, self.spec, index)
        self.files.write_state(index, "replacing", replacement_job=job.job_id)
        log.info("node%d: replacement node submitted as job %s", index, job.job_id)


def run_replacement_node(spec: JobSpec, index: int) -> None:
    """The body of a replacement node's job: join the run's Ray cluster as node ``index`` until the run is done."""
    fd = os.open(spec.side_dir.train_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1), os.dup2(fd, 2)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True,
                        format="[%(asctime)s] %(name)s: %(message)s", datefmt="%H:%M:%S")
    log.info("node%d (replacement): Slurm node %s", index, os.environ.get("SLURMD_NODENAME", "?"))
    run_worker(NodeFiles(spec.side_dir.cluster), index, node_ip(spec.cluster.loopback), num_cpus=2,
               join_timeout_s=spec.cluster.join_timeout_s, preload=forkserver_preload(spec))


def run_on_node(spec: JobSpec) -> None:
    env = submitit.JobEnvironment()
    node, tasks = env.global_rank, env.num_tasks
    if tasks != spec.nodes:
        raise ClusterError(f"the job has {tasks} task(s) but its placement {spec.nodes} nodes (one task per node)")
    files = NodeFiles(spec.side_dir.cluster)
    cluster = spec.cluster
    ip = node_ip(cluster.loopback)
    preload = forkserver_preload(spec)  # what each node's fork server imports
    log.info("node%d of %d: Slurm node %s, address %s", node, tasks, os.environ.get("SLURMD_NODENAME", "?"), ip)
    if spec.side == BASELINE:
        run_baseline(spec, node, files, ip, cluster.join_timeout_s)
    elif node == 0:
        replacer = NodeReplacer(spec, files)
        try:
            t0 = time.monotonic()
            with forkserver(preload):
                start_head(files, ip, num_cpus=2)
                wait_for_nodes(list(range(spec.nodes)), cluster.join_timeout_s)
                log.info("ray cluster: all %d nodes up %.1f s after the head started", spec.nodes,
                         time.monotonic() - t0)
                replacer.start()
                run_ft_driver(spec)
        finally:
            replacer.stop()
            files.finish()  # the worker nodes' supervisors (replacements too) end their nodes and return
            if ray.is_initialized():
                ray.shutdown()
    else:
        run_worker(files, node, ip, num_cpus=2, join_timeout_s=cluster.join_timeout_s, preload=preload)
