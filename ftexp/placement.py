"""Where each rank runs in a multi-node job: cells (and baseline ranks) laid out over the nodes.

Pure arithmetic, shared by the launcher (which starts one Ray node per Slurm node), the trainer
(which pins each cell's ranks to their nodes with a placement group) and the scenarios (which
derive what a node fault must do from the plan). A node holds ``ranks_per_node`` ranks: the
mode's ``train_gpus_per_node`` on GPUs, ``train_cpus_per_node`` on CPUs, or, when that is 0, the
ranks spread evenly over the nodes. Cells fill the nodes in order, whole cells per node; a cell
straddles nodes only when it has more ranks than a node holds. Node 0 is the head: it also runs
the driver (and the TCPStore), so a node fault may take any node but that one.

Rollout engines: on one node they run beside the trainer. A multi-node job of a mode with live,
not colocated, engines gives them nodes of their own — the **rollout nodes**, after the train
nodes, filled in order with whole engines, ``train_gpus_per_node // rollout_gpus_per_engine`` per
node: ``ceil(rollout_num_engines * rollout_gpus_per_engine / train_gpus_per_node)`` rollout nodes
when an engine's GPUs divide a node's (one node when the mode names no GPUs; an engine larger than
a node takes consecutive nodes and is placed on its first). The job then has train + rollout
nodes: ``launcher.nodes`` counts them all (``launcher.nodes=2`` with one rollout node: the cells
on node 0, the engines on node 1), and a mode's ``nodes`` (its train nodes) plus its rollout nodes
is the least a job of it gets. A one-node job keeps its engines beside the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftexp.errors import InputError


def node_resource(node: int) -> str:
    """The Ray custom resource that marks node ``node`` (placement-group bundles ask for it)."""
    return f"node{node}"


def rollout_node_layout(num_engines: int, gpus_per_engine: int, gpus_per_node: int) -> tuple[tuple[int, ...], int]:
    """([engine] -> its (first) rollout node, counted from the first rollout node; how many rollout nodes)."""
    if num_engines < 1:
        return (), 0
    if gpus_per_engine < 1 or gpus_per_node < 1:  # the mode names no GPUs: every engine on one rollout node
        return (0,) * num_engines, 1
    if gpus_per_engine <= gpus_per_node:
        per_node = gpus_per_node // gpus_per_engine
        return tuple(e // per_node for e in range(num_engines)), -(-num_engines // per_node)
    span = -(-gpus_per_engine // gpus_per_node)
    return tuple(e * span for e in range(num_engines)), num_engines * span


def rollout_nodes_of(mode) -> int:
    """How many rollout nodes a multi-node job of ``mode`` (a ModeConfig) adds to its train nodes."""
    if not mode.rollout_num_engines or mode.colocate:
        return 0
    return rollout_node_layout(mode.rollout_num_engines, mode.rollout_gpus_per_engine, mode.train_gpus_per_node)[1]


@dataclass(frozen=True)
class Placement:
    nodes: int                               # every node of the job: the train nodes, then the rollout nodes
    ranks_per_node: int
    rank_nodes: tuple[tuple[int, ...], ...]  # [cell][rank within cell] -> node
    engine_nodes: tuple[int, ...] = ()       # [rollout engine] -> its rollout node (empty: engines beside the driver)

    @classmethod
    def build(cls, num_cells: int, ranks_per_cell: int, nodes: int, ranks_per_node: int = 0) -> "Placement":
        """Lay ``num_cells`` cells of ``ranks_per_cell`` ranks over ``nodes`` nodes; InputError if they do not fit."""
        if nodes < 1:
            raise InputError(f"nodes={nodes}: a job needs at least one node")
        total = num_cells * ranks_per_cell
        per_node = ranks_per_node or -(-total // nodes)
        if total > nodes * per_node:
            raise InputError(f"{num_cells} cells x {ranks_per_cell} ranks = {total} ranks do not fit on {nodes} "
                             f"node(s) of {per_node} ranks")
        if ranks_per_cell <= per_node:  # whole cells per node
            cells_per_node = per_node // ranks_per_cell
            if num_cells > nodes * cells_per_node:
                raise InputError(f"{num_cells} cells of {ranks_per_cell} ranks do not fit whole on {nodes} node(s) of "
                                 f"{per_node} ranks ({cells_per_node} cell(s) per node)")
            layout = tuple((c // cells_per_node,) * ranks_per_cell for c in range(num_cells))
        else:  # a cell needs more ranks than a node holds: it spans consecutive nodes
            layout = tuple(tuple((c * ranks_per_cell + r) // per_node for r in range(ranks_per_cell))
                           for c in range(num_cells))
        return cls(nodes, per_node, layout)

    @classmethod
    def single_node(cls, num_cells: int, ranks_per_cell: int) -> "Placement":
        return cls(1, num_cells * ranks_per_cell, tuple((0,) * ranks_per_cell for _ in range(num_cells)))

    def with_engines(self, num_engines: int, gpus_per_engine: int, gpus_per_node: int) -> "Placement":
        """These cells' nodes, then rollout nodes of their own for ``num_engines`` engines (module docstring)."""
        offsets, rollout_nodes = rollout_node_layout(num_engines, gpus_per_engine, gpus_per_node)
        return Placement(self.nodes + rollout_nodes, self.ranks_per_node, self.rank_nodes,
                         tuple(self.nodes + offset for offset in offsets))

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def train_nodes(self) -> int:
        """Nodes 0 .. train_nodes - 1 hold the cells; the rest, if any, are rollout nodes."""
        return min(self.engine_nodes, default=self.nodes)

    @property
    def rollout_nodes(self) -> list[int]:
        return list(range(self.train_nodes, self.nodes))

    def engines_on(self, node: int) -> list[int]:
        """The rollout engines placed on ``node``."""
        return [e for e, n in enumerate(self.engine_nodes) if n == node]

    def cell_nodes(self, cell: int) -> list[int]:
        """The nodes cell ``cell`` runs on (one, unless it straddles)."""
        return sorted(set(self.rank_nodes[cell]))

    def cells_on(self, node: int) -> list[int]:
        """The cells with at least one rank on ``node``: all of them are lost when the node is."""
        return [c for c, ranks in enumerate(self.rank_nodes) if node in ranks]

    def first_rank_on(self, node: int) -> tuple[int, int] | None:
        """(cell, rank) of the first rank placed on ``node``: the one that takes the node down in a planned fault."""
        return next(((c, r) for c, ranks in enumerate(self.rank_nodes) for r, n in enumerate(ranks) if n == node), None)

    def baseline_ranks_on(self, node: int) -> list[int]:
        """The baseline's global ranks on ``node``: the world's ranks in consecutive blocks per node, as the
        target's cells fill the nodes (same number of ranks on each node as the target)."""
        counts = [sum(ranks.count(n) for ranks in self.rank_nodes) for n in range(self.nodes)]
        start = sum(counts[:node])
        return list(range(start, start + counts[node]))


def nodes_wanted(mode, requested: int) -> int:
    """The nodes a job of ``mode`` gets when ``requested`` are asked for: one, or — multi-node, when either the request
    or the mode's train nodes exceed one — the request, or more if the mode's train plus rollout nodes need more."""
    if max(requested, mode.nodes) <= 1:
        return 1
    return max(requested, mode.nodes + rollout_nodes_of(mode))


def job_nodes(cfg) -> int:
    """How many nodes the training jobs of ``cfg`` (an ExperimentConfig) get (``nodes_wanted``, from
    ``launcher.nodes``). A local launcher is one machine."""
    launcher = getattr(cfg, "launcher", None)  # (a config without a launcher: one machine)
    if launcher is None or launcher.name.value != "slurm":
        return 1
    return nodes_wanted(cfg.mode, launcher.nodes)


def placement_for(cfg) -> Placement | None:
    """The layout of ``cfg``'s cells (and rollout engines) over its job's nodes; None for a one-node job."""
    nodes = job_nodes(cfg)
    if nodes <= 1:
        return None
    mode = cfg.mode
    per_node = mode.train_gpus_per_node if cfg.launcher.gpus_per_node else mode.train_cpus_per_node
    rollout_nodes = rollout_nodes_of(mode)
    cells = Placement.build(mode.num_cells, mode.ranks_per_cell, nodes - rollout_nodes, per_node)
    if not rollout_nodes:
        return cells
    return cells.with_engines(mode.rollout_num_engines, mode.rollout_gpus_per_engine, mode.train_gpus_per_node)
