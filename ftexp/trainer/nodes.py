"""The driver's view of its nodes: their rank hosts, which nodes are up, where each cell runs, node faults.

``RankHosts`` starts one rank host (``ftexp.trainer.cell_rank``) per node, when a team of ranks first
needs it and again after its node came back, and starts the teams there. On a multi-node cluster each
host asks for its node's resource (``node<i>``, see ``ftexp.placement``), which only that node has,
so the layout the launcher planned is the one Ray enforces. After a cell is allocated the driver asks each of its ranks which node it landed on and
logs a ``CellPlacementEvent``. A planned ``restore_node_at_end`` asks the node's supervisor to bring the
node back, waits until Ray sees it alive, logs a ``NodeStateEvent`` and starts the node's cells,
which the next refresh heals.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Any

import ray

from ftexp.audit.events import CellPlacementEvent, EventLogger, NodeStateEvent
from ftexp.faults.nodes import NodeFiles
from ftexp.job import JobSpec
from ftexp.placement import Placement, node_resource
from ftexp.trainer.cell_rank import RankHandle, start_host

log = logging.getLogger(__name__)
NODE_ENV = "FTEXP_NODE_INDEX"   # every process of a Ray node inherits it: which node it runs on


class ClusterError(RuntimeError):
    """The job's Ray cluster did not form, or a node did not come back."""


def alive_nodes() -> dict[int, str]:
    """Node index -> Ray node id, for every alive node that carries a ``node<i>`` resource."""
    out = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for key in node.get("Resources", {}):
            if (m := re.fullmatch(r"node(\d+)", key)) is not None:
                out[int(m.group(1))] = node["NodeID"]
    return out


def wait_for_nodes(wanted: list[int], timeout_s: float, what: str = "join") -> dict[int, str]:
    """Block until every node in ``wanted`` is alive in the cluster; ClusterError after ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        alive = alive_nodes()
        if all(i in alive for i in wanted):
            return alive
        if time.monotonic() - t0 > timeout_s:
            missing = [f"node{i}" for i in wanted if i not in alive]
            raise ClusterError(f"Ray cluster: {', '.join(missing)} did not {what} within {timeout_s:g} s "
                               f"({len(alive)} node(s) alive; see the side's train.log for the node's own error)")
        time.sleep(0.25)


def node_of_this_process(_actor=None) -> tuple[int, str]:
    """(node index, Ray node id) of the calling process (an actor asked through ``__ray_call__``)."""
    return int(os.environ.get(NODE_ENV, "0")), ray.get_runtime_context().get_node_id()


class CellPlacer:
    """Checks that every cell's ranks run on their planned nodes."""

    def __init__(self, placement: Placement, events: EventLogger):
        self.placement, self.events = placement, events

    def log_placement(self, cell) -> None:
        """Ask each rank of a just-allocated cell where it runs; log it (and complain if not where planned)."""
        where = ray.get([rank.host.__ray_call__.remote(node_of_this_process) for rank in cell.ranks])
        nodes = [n for n, _ in where]
        planned = list(self.placement.rank_nodes[cell.index])
        self.events.log(CellPlacementEvent(cell_index=cell.index, incarnation=cell.incarnation, rank_nodes=nodes,
                                           planned_rank_nodes=planned, ray_node_ids=[i for _, i in where]))
        log.info("cell %d (incarnation %d) runs on node(s) %s", cell.index, cell.incarnation, sorted(set(nodes)))
        if nodes != planned:
            log.error("cell %d runs on nodes %s, planned %s", cell.index, nodes, planned)


def team_name(cell_index: int | None, incarnation: int) -> str:
    """A cell incarnation's team (``cell2.inc1``), or a warm spare's (``spare3``)."""
    return f"spare{incarnation}" if cell_index is None else f"cell{cell_index}.inc{incarnation}"


class RankHosts:
    """The driver's rank hosts, one per node of ``placement``, each started when a team first needs it and again
    after its node came back; ``spare_cells`` warm spares' teams live on node 0 beside the cells'. ``pinned``: a
    host must run on its node (a multi-node cluster's ``node<i>`` resource), else on the driver's."""

    def __init__(self, spec: JobSpec, store_addr: str, placement: Placement, spare_cells: int, pinned: bool):
        self.spec, self.store_addr, self.placement, self.spare_cells = spec, store_addr, placement, spare_cells
        self.pinned = pinned
        self._hosts: dict[int, tuple[Any, ray.ObjectRef, str | None]] = {}  # node -> (host, its until_gone call,
        # the Ray node it runs on where pinned)
        self._lock = threading.Lock()  # cells start from the driver's loop and the control plane's threads

    def team(self, cell_index: int | None, incarnation: int) -> list[RankHandle]:
        """Start a team on each node its ranks are placed on (in the background); a handle per rank, in rank
        order. A spare (``cell_index`` None) is laid out as cell 0 is."""
        team = team_name(cell_index, incarnation)
        nodes = self.placement.rank_nodes[0 if cell_index is None else cell_index]
        handles = []
        for node in sorted(set(nodes)):
            ranks = [r for r, n in enumerate(nodes) if n == node]
            with self._lock:
                host = self._host(node)
            host.start.remote(team, self.spec, cell_index, ranks, self.store_addr, incarnation)
            handles += [RankHandle(host, team, r) for r in ranks]
        return sorted(handles, key=lambda h: h.rank)

    def _host(self, node: int) -> Any:
        """The node's host: a new one if there is none yet, or if the one there was is gone with its node."""
        known = self._hosts.get(node)
        if known is not None:
            host, until_gone, ray_node = known
            gone, _ = ray.wait([until_gone], timeout=0)
            if not gone and (ray_node is None or ray_node in _alive_node_ids()):
                return host
            log.warning("node %d's rank host is gone; starting another", node)
        cells_ranks = sum(nodes.count(node) for nodes in self.placement.rank_nodes)
        spares_ranks = self.spare_cells * self.placement.rank_nodes[0].count(node)
        options, ray_node = {}, None
        if self.pinned:
            options["resources"] = {node_resource(node): 1}
            ray_node = alive_nodes().get(node)
        host = start_host(f"node{node}", cells_ranks, cells_ranks + spares_ranks, **options)
        self._hosts[node] = (host, host.until_gone.remote(), ray_node)
        return host

    def shutdown(self) -> None:
        """End every host, and with them their ranks' processes."""
        with self._lock:
            hosts, self._hosts = list(self._hosts.values()), {}
        for host, _, _ in hosts:
            ray.kill(host, no_restart=True)


def _alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def restore_node(files: NodeFiles, node: int, events: EventLogger, timeout_s: float) -> None:
    """Bring ``node`` back (its supervisor starts a fresh Ray node) and wait until Ray sees the new node alive and
    the lost one dead: until then a rank host asking for ``node<i>`` could land on the lost node."""
    asked = time.time()
    lost = (files.read_state(node) or {}).get("ray_node_id")
    files.request_up(node)
    deadline, new, rejoined, lost_dead = time.monotonic() + timeout_s, None, None, None
    while rejoined is None or lost_dead is None:
        if time.monotonic() > deadline:
            raise ClusterError(f"node{node} did not come back within {timeout_s:g} s (new node alive: "
                               f"{rejoined is not None}; lost node declared dead: {lost_dead is not None})")
        state = files.read_state(node) or {}
        if new is None and state.get("state") == "up" and state.get("up_at", 0) >= asked:
            new = state.get("ray_node_id")
        alive = _alive_node_ids()
        if rejoined is None and new is not None and new in alive:
            rejoined = time.time()
        if lost_dead is None and lost not in alive:
            lost_dead = time.time()
        time.sleep(0.25)
    state = files.read_state(node) or {}
    timings = {"rejoin_s": round(rejoined - asked, 3), "lost_node_declared_dead_s": round(lost_dead - asked, 3)}
    if "down_at" in state:
        timings["down_s"] = round(asked - state["down_at"], 3)
    events.log(NodeStateEvent(node_index=node, state="rejoined", ray_node_id=new, timings=timings))
    log.info("node %d is back as Ray node %s (%s)", node, new, timings)

