"""One Ray cluster across the nodes of a multi-node job (``launcher.nodes > 1`` on Slurm).

Slurm runs the side's job body once per node (one task per node). Task 0 starts the Ray head with
the custom resource ``node0`` and runs the driver; task i starts a Ray worker node with ``node<i>``
and supervises it until the job is over. The head publishes its GCS address in the side's
``cluster/`` directory (``ftexp.faults.nodes``) and waits until every node has joined; past
``launcher.ray.join_timeout_s`` it fails with one line naming the missing nodes.

Addresses: with ``launcher.ray.loopback`` (or, by default, when the Slurm node's NodeAddr is a
loopback address, as on the local multi-node cluster) every node is on 127.0.0.1; otherwise each
node uses its own address. Worker nodes are started from Python (Ray's ``Node``), since ``ray start
--address`` panics with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which keeps Ray on loopback.

Node faults: a worker node's supervisor takes its node away when asked (``node<i>.down``: every
process of that Ray node SIGKILLed, workers first, by PID) and starts a fresh Ray node with the
same ``node<i>`` resource when asked to bring it back (``node<i>.up``).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import ray
import psutil  # noqa: E402  (Ray's thirdparty_files, on sys.path once ray is imported)

from ftexp.faults.nodes import NodeFiles
from ftexp.forkserver import forkserver
from ftexp.placement import node_resource
from ftexp.trainer.local_ray import start_local_ray
from ftexp.trainer.nodes import NODE_ENV, ClusterError, wait_for_nodes  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"
# A node's custom resource: placement bundles take 1 per rank; a node never runs out of it.
NODE_SLOTS = 10_000
HEAD_GONE_S = 30.0              # a worker gives up its node when the head stopped answering this long


# ---- addresses ---------------------------------------------------------------------------------


def _slurm_node_addr() -> str | None:
    """This Slurm node's NodeAddr (what slurm.conf says it is reached at), if Slurm answers."""
    name = os.environ.get("SLURMD_NODENAME")
    if not name:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "-o"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match else None


def _is_ip(text: str | None) -> bool:
    try:
        ipaddress.ip_address(text or "")
        return True
    except ValueError:
        return False


def node_ip(loopback: bool | None) -> str:
    """The address this node's Ray processes bind to and advertise (never a hostname: lookups may leave the machine)."""
    if loopback:
        return LOOPBACK
    addr = _slurm_node_addr()
    if _is_ip(addr):
        if not ipaddress.ip_address(addr).is_loopback:
            return addr          # a real cluster: the node's own address
        if loopback is None:
            return LOOPBACK      # the local multi-node cluster: every node at 127.0.0.1
    elif loopback is None and addr is None:
        return LOOPBACK          # not under Slurm: one machine
    from ray._private.services import get_node_ip_address
    return get_node_ip_address()


# ---- the head ----------------------------------------------------------------------------------


def start_head(files: NodeFiles, ip: str, num_cpus: int) -> str:
    """Start this process's Ray head (node 0) and publish its GCS address; returns it."""
    os.environ[NODE_ENV] = "0"
    t0 = time.monotonic()
    start_local_ray(num_cpus, node_ip=ip, resources={node_resource(0): NODE_SLOTS})
    address = ray.get_runtime_context().gcs_address
    files.publish("head", {"gcs_address": address, "ip": ip})
    log.info("ray head (node 0) up at %s in %.1f s", address, time.monotonic() - t0)
    return address


# ---- a worker node -----------------------------------------------------------------------------


def socket_dir_prefix(files: NodeFiles) -> str:
    """How the socket directories of a run's worker nodes start, in the system's temporary directory: named after
    the side's cluster directory, so that what a run left behind is told apart from another run's."""
    return f"ftexp-ray-{hashlib.sha1(str(files.root.resolve()).encode()).hexdigest()[:8]}-node"


class WorkerNode:
    """One Ray worker node, with its fork server (importing ``preload``), started and ended by this process."""

    def __init__(self, files: NodeFiles, index: int, gcs_address: str, ip: str, num_cpus: int,
                 preload: tuple[str, ...]):
        self.files, self.index, self.gcs_address, self.ip = files, index, gcs_address, ip
        self.num_cpus, self.preload = num_cpus, preload
        self.node = None
        self.socket_dir = None
        self.forkserver = contextlib.ExitStack()

    def start(self) -> None:
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        os.environ[NODE_ENV] = str(self.index)  # the raylet and every worker it starts inherit it
        self.forkserver.enter_context(forkserver(self.preload))  # its address too
        # Nodes on one machine share the session's sockets directory, where Ray names a node's plasma and
        # raylet sockets by the first index not yet bound: nodes starting together pick the same names and
        # all but one fail to bind (seen with 5 worker nodes). Each node start gets sockets of its own.
        self.socket_dir = tempfile.mkdtemp(prefix=f"{socket_dir_prefix(self.files)}{self.index}-")
        params = RayParams(gcs_address=self.gcs_address, node_ip_address=self.ip, num_cpus=self.num_cpus,
                           resources={node_resource(self.index): NODE_SLOTS}, node_manager_port=0,
                           min_worker_port=0, max_worker_port=0, object_store_memory=100 * 1024 * 1024,
                           plasma_store_socket_name=os.path.join(self.socket_dir, "plasma_store"),
                           raylet_socket_name=os.path.join(self.socket_dir, "raylet"),
                           # nodes sharing one machine share one session dir: one log monitor (the head's)
                           include_log_monitor=self.ip != LOOPBACK)
        params.dashboard_agent_listen_port = None  # a free port: several nodes may share the machine
        self.node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)

    @property
    def node_id(self) -> str | None:
        return self.node.node_id if self.node is not None else None

    def _raylet(self) -> psutil.Process | None:
        infos = (self.node.all_processes.get("raylet") if self.node is not None else None) or []
        with contextlib.suppress(psutil.Error, IndexError):
            return psutil.Process(infos[0].process.pid)
        return None

    def alive(self) -> bool:
        raylet = self._raylet()
        try:
            return raylet is not None and raylet.is_running() and raylet.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def kill(self) -> int:
        """Take the node away hard: SIGKILL the raylet's workers, then the node's own processes. How many died."""
        if self.node is None:  # never started, already taken away, or its start failed after making the directory
            self.forkserver.close()
            self.remove_socket_dir()
            return 0
        raylet = self._raylet()
        workers = []
        if raylet is not None:
            with contextlib.suppress(psutil.Error):
                workers = raylet.children(recursive=True)
        for proc in workers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        psutil.wait_procs(workers, timeout=5)
        killed = len(workers) + sum(len(v) for v in self.node.all_processes.values())
        self.node = None
        self.forkserver.close()  # and the processes it forked, should any have outlived their actors
        self.remove_socket_dir()
        return killed

    def remove_socket_dir(self) -> None:
        """Unlink the node's socket files, if it made any. Its processes keep the sockets they bound and their
        connections."""
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def _set_slurm_node_down(index: int) -> bool:
    """``scontrol update state=down`` on this task's Slurm node; False (and why, logged) if that did not work."""
    name = os.environ.get("SLURMD_NODENAME")
    if not name:
        log.error("node%d: not under Slurm; taking the Ray node away instead", index)
        return False
    log.warning("node%d: setting Slurm node %s down (Slurm then ends this task)", index, name)
    sys.stdout.flush()
    done = subprocess.run(["scontrol", "update", f"nodename={name}", "state=down", "reason=ftexp node fault"],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        log.error("node%d: scontrol could not set %s down (%s); taking the Ray node away instead", index, name,
                  (done.stderr or done.stdout).strip())
        return False
    return True


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def run_worker(files: NodeFiles, index: int, ip: str, num_cpus: int, join_timeout_s: float,
               preload: tuple[str, ...]) -> None:
    """Task ``index`` of a multi-node job: join the head's cluster and keep this node up (or down, when a
    node fault says so) until the head says the job is done or stops answering. ``preload``: what the node's
    fork server imports (the ranks' and the rollout engines' modules)."""
    head = files.wait_for("head", join_timeout_s, abandon=files.finished)
    if head is None:
        if files.finished():
            return
        raise ClusterError(f"node{index}: the head (task 0) did not publish its address within {join_timeout_s:g} s")
    node = WorkerNode(files, index, head["gcs_address"], ip, num_cpus, preload)
    t0 = time.monotonic()
    node.start()
    files.write_state(index, "up", up_at=time.time(), ray_node_id=node.node_id)
    log.info("node%d: ray worker node up at %s in %.1f s (head %s)", index, ip, time.monotonic() - t0,
             head["gcs_address"])
    head_silent_since = None
    try:
        while not files.finished():
            if node.node is not None and (down := files.take_request(index, "down")) is not None:
                how = down.get("how", "ray")
                files.write_state(index, "down", down_at=time.time(), how=how)
                if how == "slurm":
                    # Slurm may end this task before anything after the call below runs: the node's socket files
                    # go first, or they would be left in the temporary directory.
                    node.remove_socket_dir()
                if how == "slurm" and _set_slurm_node_down(index):
                    # Slurm now ends this task, and the Ray node's processes (the step's) with it; the job goes
                    # on without this node (--no-kill). Whatever is left ends here; a replacement node brings it back.
                    killed = node.kill()
                    log.warning("node%d: Slurm node set down (node fault); %d processes left were killed", index, killed)
                    return
                killed = node.kill()
                log.warning("node%d: taken away (node fault): %d processes killed", index, killed)
            elif node.node is None and files.take_request(index, "up") is not None:
                t0 = time.monotonic()
                node.start()
                files.write_state(index, "up", up_at=time.time(), ray_node_id=node.node_id)
                log.info("node%d: back, a fresh ray node in %.1f s", index, time.monotonic() - t0)
            elif node.node is not None and not node.alive():
                log.error("node%d: its raylet died", index)
                node.kill()
                files.write_state(index, "down", down_at=time.time())
            if _reachable(head["gcs_address"]):
                head_silent_since = None
            elif head_silent_since is None:
                head_silent_since = time.monotonic()
            elif time.monotonic() - head_silent_since > HEAD_GONE_S:
                log.error("node%d: the head stopped answering for %.0f s; leaving", index, HEAD_GONE_S)
                break
            time.sleep(0.2)
    finally:
        node.kill()
    log.info("node%d: done", index)
