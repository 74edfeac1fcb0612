"""The driver's view of a multi-node Ray cluster: which nodes are up, where each cell runs, node faults.

Each cell incarnation gets one placement group with a bundle per node its ranks are planned on,
asking for that node's resource (``node<i>``, see ``ftexp.placement``); the actor hosting the cell's
ranks on that node takes the bundle, so the layout the launcher planned is the one Ray enforces.
After a cell is allocated the driver asks each of its ranks which node it landed on and logs a
``CellPlacementEvent``. A planned ``restore_node_at_end`` asks the node's supervisor to bring the
node back, waits until Ray sees it alive, logs a ``NodeStateEvent`` and starts the node's cells,
which the next refresh heals.
"""

from __future__ import annotations

import logging
import os
import re
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ftexp.audit.events import CellPlacementEvent, EventLogger, NodeStateEvent
from ftexp.faults.nodes import NodeFiles
from ftexp.placement import Placement, node_resource

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
    """Pins every cell's ranks to their planned nodes: one placement group per cell incarnation."""

    def __init__(self, placement: Placement, events: EventLogger):
        self.placement, self.events = placement, events
        self.groups: dict[int, object] = {}  # cell -> its current incarnation's placement group

    def actors_of(self, cell: int, incarnation: int) -> list[tuple[list[int], dict]]:
        """This incarnation of ``cell``'s actors, one per node it spans: the ranks each hosts, and the
        ``.options(...)`` that put it on their node."""
        if cell in self.groups:
            remove_placement_group(self.groups[cell])  # the previous incarnation's actors are dead already
        rank_nodes = self.placement.rank_nodes[cell]
        nodes = sorted(set(rank_nodes))
        group = placement_group([{node_resource(n): 1} for n in nodes], strategy="PACK",
                                name=f"cell{cell}_inc{incarnation}")
        self.groups[cell] = group
        return [([r for r, n in enumerate(rank_nodes) if n == node],
                 {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)})
                for i, node in enumerate(nodes)]

    def log_placement(self, cell) -> None:
        """Ask each rank of a just-allocated cell where it runs; log it (and complain if not where planned)."""
        where = ray.get([a.actor.__ray_call__.remote(node_of_this_process) for a in cell.ranks])
        nodes = [n for n, _ in where]
        planned = list(self.placement.rank_nodes[cell.index])
        self.events.log(CellPlacementEvent(cell_index=cell.index, incarnation=cell.incarnation, rank_nodes=nodes,
                                           planned_rank_nodes=planned, ray_node_ids=[i for _, i in where]))
        log.info("cell %d (incarnation %d) runs on node(s) %s", cell.index, cell.incarnation, sorted(set(nodes)))
        if nodes != planned:
            log.error("cell %d runs on nodes %s, planned %s", cell.index, nodes, planned)

    def shutdown(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}


def _alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def restore_node(files: NodeFiles, node: int, events: EventLogger, timeout_s: float) -> None:
    """Bring ``node`` back (its supervisor starts a fresh Ray node) and wait until Ray sees the new node alive and
    the lost one dead: until then a placement bundle asking for ``node<i>`` could land on the lost node."""
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

